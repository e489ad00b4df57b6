"""A windowed model's personas (engine/kv/rings.py): the ring as the persona's last full block left
it is copied and kept apart, so every chat on the persona goes on from it, and an edited message
goes back to it rather than to the start."""
import pytest
import torch

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.core.kv_sizes import KVShape
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.rings import MAX_PERSONAS, Rings

from test_rings import BS, expected
from tiny_models import as_loaded, tiny_model

PERSONA = ("You are Marlowe, a patient reference librarian in a small harbour town. Answer in full "
           "sentences, name your sources, and say so when you do not know. ") * 2


def windowed(kind, tokenizer):
    """A tiny windowed model on the starter's vocabulary (its chat template), with a window of
    256: a ring of 17 blocks. Every layer of Mistral v0.1 is windowed (the pool is three rings);
    Gemma 3 keeps one layer in six whole in the pool's blocks."""
    return tiny_model(kind, max_position_embeddings=4096, vocab_size=len(tokenizer), sliding_window=256)


def start(model, tokenizer, disk_tier=True) -> Engine:
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(model, tokenizer), disk_tier=disk_tier)
    engine.model = model
    engine.wait_ready()  # its formatter is made on the engine thread
    return engine


@pytest.fixture(params=["mistral-window"])
def engine(request, tokenizer):
    # no disk tier: the session's would carry one test's persona rings into the next
    engine = start(windowed(request.param, tokenizer), tokenizer, disk_tier=None)
    yield engine
    engine.close()


def ask(engine, question, new, persona=PERSONA):
    """A greedy reply to ``question`` under ``persona``, and the reply transformers gives."""
    messages = [{"role": "system", "content": persona}, {"role": "user", "content": question}]
    done = engine.submit(Request(messages=messages, sampling=SamplingParams(
        max_new_tokens=new, temperature=0, ignore_eos=True))).result()
    ids = engine.session.formatter.encode(messages).token_ids
    return done, expected(engine.model, ids, new)


def persona_tokens(engine, persona=PERSONA) -> int:
    """The persona's full blocks, in tokens: where its ring is copied."""
    encoded = engine.session.formatter.encode([{"role": "system", "content": persona}, {"role": "user", "content": "."}])
    return encoded.message_starts[1] // BS * BS


def shared(engine, a, b) -> int:
    """Tokens the prompts of questions ``a`` and ``b`` (on ``PERSONA``) begin with alike."""
    ids = [engine.session.formatter.encode([{"role": "system", "content": PERSONA}, {"role": "user", "content": q}]).token_ids
           for q in (a, b)]
    return next(i for i, (x, y) in enumerate(zip(*ids)) if x != y)


@pytest.mark.parametrize("engine", ["mistral-window", "gemma3"], indirect=True)
@torch.inference_mode()
def test_a_persona_stays_warm_after_a_long_question_and_the_next_chat_goes_on_from_its_ring(engine):
    """A 300-token question moves every ring of the chat past the persona's window. The persona's
    own copy stays: the badge says "warm", and two more chats on it each go on from a copy of it
    (its 64 tokens cached; the template's next tokens cached too where a kept ring holds them),
    with transformers' replies. Before, the badge said "cold" and the next chat computed it all."""
    p = persona_tokens(engine)
    assert p == 64
    assert engine.persona_state(PERSONA, 30) == "cold"
    done, want = ask(engine, "Summarise this: " + "tide " * 300, 4)
    assert done.stats.cached_tokens == 0 and done.token_ids == want
    assert engine.persona_state(PERSONA, 30) == "warm"
    rings = engine.kvpool.rings
    assert [len(tokens) for tokens, _, _ in rings.personas] == [p]
    done, want = ask(engine, "Hey", 6)
    assert done.stats.cached_tokens == p and done.token_ids == want
    done, want = ask(engine, "What opens at nine?", 6)  # "Hey"'s kept ring holds what the two share
    assert done.stats.cached_tokens == shared(engine, "Hey", "What opens at nine?") > p
    assert done.token_ids == want
    assert [len(tokens) for tokens, _, _ in rings.personas] == [p]  # copied, never taken over


@pytest.mark.parametrize("engine", ["mistral-window", "gemma3"], indirect=True)
@torch.inference_mode()
def test_an_edited_long_message_goes_back_to_the_personas_ring_not_to_the_start(engine):
    """The question edited in its first words: the pool still holds the persona's blocks and the
    question's first tokens, but no kept ring holds that window. The prefix is cut back to the
    persona's 64 tokens, whose ring is kept, and only the rest is computed; the reply is
    transformers'. Before, the whole prompt was computed again (0 cached)."""
    text = " ".join(f"line {i}: the tide rose" for i in range(60))
    ask(engine, "Please read: " + text, 8)
    done, want = ask(engine, "Kindly read: " + text, 8)
    assert done.stats.cached_tokens == persona_tokens(engine) and done.token_ids == want


@torch.inference_mode()
def test_persona_rings_go_after_the_kept_ones_and_the_least_used_of_five_goes(engine):
    """Three 200-token chats take the kept rings' blocks, not the persona's. Three more personas,
    then a chat on the first (its ring copied: the last used now), then a fifth persona: the
    second persona's ring goes, the least recently used (as a fifth pinned persona unpins the
    least used one's blocks), and the first persona's next chat still goes on from its ring, as
    transformers says."""
    p = persona_tokens(engine)
    assert ask(engine, "Hi", 2)[0].stats.cached_tokens == 0
    for seed in range(3):  # plain prompts of 200 tokens: all three rings' worth of blocks in use, in turn
        engine.submit(Request(prompt_ids=[5 + (i * 7 + seed) % 400 for i in range(200)],
                              sampling=SamplingParams(max_new_tokens=3, temperature=0, ignore_eos=True))).result()
    assert engine.persona_state(PERSONA, 30) == "warm"
    others = [f"You are helper number {n}, terse and exact, and you answer in one line. " * 3 for n in range(MAX_PERSONAS)]
    for persona in others[:-1]:
        ask(engine, "Hi", 2, persona=persona)
    assert ask(engine, "Hello there", 2)[0].stats.cached_tokens == p
    ask(engine, "Hi", 2, persona=others[-1])
    rings = engine.kvpool.rings
    prefixes = [engine.session.formatter.encode([{"role": "system", "content": x}, {"role": "user", "content": "."}]).token_ids[:48]
                for x in [PERSONA, *others]]
    assert [prefixes.index(tokens[:48]) for tokens, _, _ in rings.personas] == [2, 3, 0, 4]  # others[0]'s went
    done, want = ask(engine, "Hi again", 4)
    assert done.stats.cached_tokens == p and done.token_ids == want


@torch.inference_mode()
def test_a_restart_goes_on_from_the_personas_ring_on_disk(tokenizer, tmp_path):
    """Gemma 3: the persona's whole-context blocks were on disk, but not its windowed layers'
    rows, so after a restart every chat on it computed it again. Its ring is written beside its
    blocks at the turn's end (pinned, as they are): after a restart the badge says "disk", and the
    first chat restores both (its 64 tokens from disk), with transformers' reply."""
    model = windowed("gemma3", tokenizer)
    first = start(model, tokenizer, DiskTier(tmp_path))
    try:
        ask(first, "Summarise this: " + "tide " * 300, 2)
    finally:
        first.close()
    p = persona_tokens(first)
    again = start(model, tokenizer, DiskTier(tmp_path))
    try:
        assert again.persona_state(PERSONA, 30) == "disk"
        done, want = ask(again, "What opens at nine?", 6)
        assert done.stats.cached_tokens == done.stats.disk_tokens == p and done.token_ids == want
        assert again.persona_state(PERSONA, 30) == "warm"
    finally:
        again.close()


def test_a_persona_ring_is_the_personas_blocks_and_taking_blocks_evicts_only_what_it_uses():
    """Bookkeeping alone (no model): a persona's copy takes the ring blocks of the persona's own
    blocks (a ring taken over from a longer chat holds that chat's rows past them, which a
    pinned disk copy would keep after the chat is deleted); taking free blocks evicts kept rings
    only where they make enough, a persona's never."""
    shape = KVShape.from_config(tiny_model("gemma3", max_position_embeddings=4096).config)
    rings = Rings(shape, BS, 16, place=lambda ids, ring: None)
    copies = []
    seq = Sequence(list(range(100)), ring=[0, 1, 2, 3, 4], num_computed=2 * BS)
    rings.free = list(range(5, 16))
    tokens, ring, top = rings.keep_persona(seq, lambda source, target: copies.append((source, target)))
    assert copies == [([0, 1], [5, 6])] and ring == [5, 6] and tokens == list(range(2 * BS)) and top == 1
    rings.free, rings.kept = [7, 8], [([1] * BS, [9, 10], 0), ([2] * BS, [11, 12], 0)]
    assert rings.take_free(7) is None and rings.free == [7, 8] and len(rings.kept) == 2  # 6 at most: none evicted
    assert rings.take_free(5) == [7, 8, 9, 10, 11] and rings.kept == [] and rings.free == [12]
    assert [r for _, r, _ in rings.personas] == [[5, 6]]
