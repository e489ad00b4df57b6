"""The windowed layers' rings (engine/kv/rings.py): a long chat with a windowed model holds its
windowed layers' K/V in a ring of window + one block, and says what transformers says."""
import json

import pytest
import torch

from kvchat.bench.decode import IdTokenizer
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.core.events import Request
from kvchat.core.kv_sizes import LOCAL_RINGS, KVShape, layer_windows, pool_bytes, ring_blocks
from kvchat.engine.engine import Engine
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool

from test_parity import prompt
from tiny_models import WINDOW, as_loaded, tiny_model

BS = 16
RING = -(-(WINDOW - 1) // BS) + 1  # 5 blocks: 80 tokens, the window and one block


@pytest.fixture(scope="module")
def gemma3():
    return tiny_model("gemma3", max_position_embeddings=4096)


def pool_for(model, precision, tokens=2048, rings=True):
    lm = as_loaded(model, IdTokenizer(512))  # calibration's text as ids the tiny vocabulary has
    shape = KVShape.from_config(model.config)
    return KVPool(lm, BS, precision, pool_bytes(shape, precision, tokens, 4, BS, rings),
                  local_blocks=None if rings else 0)


def run(pool, ids, chunk, steps):
    """Prefill ``ids`` in chunks, then greedy ``steps``; the logits of each decode step and the
    ring blocks the sequence held at most."""
    seq, out, held = Sequence(list(ids)), [], 0
    pool.manager.reserve(seq, len(seq))
    logits = None
    while seq.num_computed < len(seq):
        end = min(seq.num_computed + chunk, len(seq))
        logits = pool.runner.forward(seq, end, want_logits=end == len(seq))
    for _ in range(steps):
        out.append(logits)
        seq.token_ids.append(int(logits.argmax()))
        pool.manager.reserve(seq, len(seq))
        held = max(held, len(seq.ring))
        logits = pool.runner.forward(seq, len(seq), want_logits=True)
    return torch.stack(out), held


def test_the_configs_windows_per_layer():
    """As transformers gives each layer its window; a config.json without ``layer_types`` gets its
    class's pattern."""
    assert layer_windows(tiny_model("gemma3").config) == (WINDOW,) * 5 + (None,)
    assert layer_windows({"model_type": "gemma2", "num_hidden_layers": 4, "sliding_window": 4096}) == \
        (4096, None, 4096, None)
    assert layer_windows({"model_type": "gemma3_text", "num_hidden_layers": 12, "sliding_window": 512}) == \
        ((512,) * 5 + (None,)) * 2
    assert layer_windows({"model_type": "qwen2", "num_hidden_layers": 4, "sliding_window": 4096,
                          "use_sliding_window": False}) == ()
    assert layer_windows({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 4096}) == (4096, 4096)
    assert layer_windows({"model_type": "llama", "num_hidden_layers": 2}) == ()


def test_gemma_2s_kv_bytes_at_32k_count_its_local_layers_at_their_rings():
    """Gemma-2-9B: 42 layers, 8 KV heads of 256, every other layer windowed at 4,096. At fp16 a
    token of one layer is 2 x 8 x 256 x 2 = 8 KiB; at 32k the 21 global layers take 32,768 tokens
    and the 21 local ones three rings of 257 blocks."""
    shape = KVShape(42, 8, 256, (4096, None) * 21)
    assert ring_blocks(shape, BS) == 257
    global_bytes = 21 * 32768 * 8192
    rings = 21 * LOCAL_RINGS * 257 * BS * 8192
    assert pool_bytes(shape, Precision.FP16, 32768, 2, BS) == global_bytes + rings
    assert pool_bytes(shape, Precision.FP16, 32768, 2, BS, rings=False) == 2 * global_bytes
    # a context below three rings keeps every layer whole: rings would take more
    assert pool_bytes(shape, Precision.FP16, 8192, 2, BS) == 42 * 8192 * 8192


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int8", "int4"])
@torch.inference_mode()
def test_a_long_sequence_in_rings_says_what_the_whole_pool_says(gemma3, precision):
    """A 600-token prompt in one chunk (longer than the ring: it reads its window before its rows
    overwrite the ring, and only its newest rows are written), then 150 decode steps: the same
    logits as a pool whose windowed layers keep everything, while the sequence holds 5 ring blocks."""
    ids = prompt(600, seed=5)
    whole, _ = run(pool_for(gemma3, precision, rings=False), ids, 1024, 150)
    pool = pool_for(gemma3, precision)
    assert pool.rings is not None and pool.kv.local == frozenset(range(5))
    assert [layer["k"].shape[0] for layer in pool.kv.layers] == [RING * LOCAL_RINGS] * 5 + [pool.blocks.num_blocks]
    ringed, held = run(pool, ids, 1024, 150)
    assert held == RING
    assert (ringed - whole).abs().max().item() <= 1e-4


# the largest logit error at the end of two 600-token prompts in 512-token chunks, rings against
# the whole pool's (whose chunk writes before it reads, so its full-precision window of 64 rows has
# moved past the chunk's first queries' window; a ring's chunk reads the window first)
CHUNKED = {"fp16": (2e-6, 2e-6), "int8": (2.5e-4, 4.5e-3), "int4": (5.1e-3, 6.5e-2)}


@pytest.mark.parametrize("precision", sorted(CHUNKED))
@torch.inference_mode()
def test_a_chunked_prompt_in_rings_matches_transformers(gemma3, precision):
    ids = prompt(600, seed=5)
    logits, _ = run(pool_for(gemma3, precision), ids, 512, 1)
    error = (logits[0] - gemma3(torch.tensor([ids])).logits[0, -1]).abs().max().item()
    assert error <= max(2 * CHUNKED[precision][0], 1e-4)


def chat(engine, ids, new):
    done = engine.submit(Request(prompt_ids=list(ids), sampling=SamplingParams(
        max_new_tokens=new, temperature=0, ignore_eos=True))).result()
    return done


def expected(model, ids, new):
    return model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(ids):].tolist()


def test_a_2000_token_chat_holds_one_ring_and_its_next_turn_goes_on_from_it(gemma3, tokenizer):
    """Four turns to 2,000 tokens through the engine (the default 512-token chunks): each turn's
    reply is transformers' greedy one; a turn goes on from the last one's ring (its cached tokens
    counted), and the windowed layers never hold more than window + one block of it. Another
    chat's request in between leaves the chat's ring kept; three more take it (three rings): the
    chat's turn is then computed again, and is still right."""
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(gemma3, tokenizer))
    try:
        history = prompt(400, seed=7)
        cached = []
        for turn in range(4):
            done = chat(engine, history, 60)
            pool = engine.kvpool
            assert pool.rings is not None and pool.rings.size == RING
            assert done.token_ids == expected(gemma3, history, 60)
            cached.append(done.stats.cached_tokens)
            history = history + done.token_ids + prompt(420, seed=10 + turn)
            # the copy of the ring its prompt left (for a regenerate), and the ended turn's ring: 80 tokens each
            assert [len(ring) for _, ring, _ in pool.rings.kept] == [RING, RING]
        assert len(history) > 2000
        assert cached[0] == 0 and all(n > 300 for n in cached[1:])
        chat(engine, prompt(120, seed=20), 5)  # another chat: its ring is kept beside this one's
        done = chat(engine, history, 20)
        assert done.stats.cached_tokens > 1500 and done.token_ids == expected(gemma3, history, 20)
        history = history + done.token_ids + prompt(30, seed=25)
        for seed in (21, 22, 23):  # three more chats: the third takes this chat's ring, the oldest kept
            chat(engine, prompt(120, seed=seed), 5)
        done = chat(engine, history, 20)
        assert done.stats.cached_tokens == 0
        assert done.token_ids == expected(gemma3, history, 20)
    finally:
        engine.close()


def compiled_ring_pool(model, precision):
    """A ring pool whose runner decodes with the compiled step (the op's graph: a ring is read
    through the cache's block map, which the traced graph does not do), compiled now."""
    from kvchat.engine.model.runner import ModelRunner

    pool = pool_for(model, precision)
    pool.runner = ModelRunner(pool.lm.model, pool.kv, pool.manager, "compiled")
    assert pool.runner.step.prepare(pool.kv) or pool.runner.step.background.known("op")
    assert pool.runner.step.background.wait(900) and pool.runner.step.fallback is None
    return pool


@pytest.mark.slow
@torch.inference_mode()
def test_the_compiled_step_over_rings_decodes_as_eager(gemma3):
    ids = prompt(100, seed=8)
    eager, _ = run(pool_for(gemma3, "fp16"), ids, 512, 120)
    pool = compiled_ring_pool(gemma3, "fp16")
    compiled, held = run(pool, ids, 512, 120)
    assert pool.runner.step.replays >= 119 and held == RING
    assert (compiled - eager).abs().max().item() <= 1e-4


@pytest.mark.parametrize("precision", ["fp16", "int4"])
@torch.inference_mode()
def test_a_batch_decodes_each_ringed_sequence_as_it_decodes_alone(gemma3, precision):
    """Two sequences past their windows, each in its own ring, decoded as one batch: each row's
    logits as its sequence's alone."""
    pool = pool_for(gemma3, precision)
    seqs = [Sequence(prompt(n, seed=n)) for n in (150, 230)]
    for seq in seqs:
        pool.manager.reserve(seq, len(seq) - 1)
        pool.runner.forward(seq, len(seq) - 1, want_logits=False)
    alone = []
    for _ in range(20):
        for seq in seqs:
            pool.manager.reserve(seq, len(seq))
        both = pool.runner.decode(seqs)
        for seq, row in zip(seqs, both):
            seq.token_ids.append(int(row.argmax()))
        alone.append(both)
    assert seqs[0].ring != seqs[1].ring and len(set(seqs[0].ring) | set(seqs[1].ring)) == 2 * RING
    for i, seq in enumerate(seqs):
        single = pool_for(gemma3, precision)
        solo = Sequence(seq.token_ids[:-20])
        single.manager.reserve(solo, len(solo) - 1)
        single.runner.forward(solo, len(solo) - 1, want_logits=False)
        for step in range(20):
            single.manager.reserve(solo, len(solo))
            row = single.runner.decode([solo])[0]
            assert (row - alone[step][i]).abs().max().item() <= 1e-4
            solo.token_ids.append(seq.token_ids[len(solo)])


@torch.inference_mode()
def test_a_downshift_converts_the_rings_too(gemma3):
    """fp16 -> int8 in the middle of a sequence past its window: the rings and the whole-context
    blocks are converted alike, so the next steps say what a whole pool converted at the same
    token says."""
    ids = prompt(200, seed=9)
    out = []
    for rings in (False, True):
        pool = pool_for(gemma3, "fp16", rings=rings)
        seq = Sequence(list(ids))
        pool.manager.reserve(seq, len(seq))
        logits = pool.runner.forward(seq, len(seq), want_logits=True)
        rows = []
        for step in range(40):
            if step == 10:
                assert pool.rebuild(Precision.INT8, pool.budget, [seq])
            seq.token_ids.append(int(logits.argmax()))
            pool.manager.reserve(seq, len(seq))
            logits = pool.runner.forward(seq, len(seq), want_logits=True)
            rows.append(logits)
        out.append(torch.stack(rows))
    assert (out[0] - out[1]).abs().max().item() <= 1e-4


def test_more_long_requests_than_rings_wait_for_one_and_say_the_same(gemma3, tokenizer):
    """Five requests past their windows at once, with three rings: those without a ring wait (or
    a newer one is preempted) until one is free; every reply is transformers' greedy one."""
    engine = Engine(EngineConfig(max_context=4096, max_running=5, kv_precision="auto"),
                    loaded=as_loaded(gemma3, tokenizer))
    try:
        prompts = [prompt(150 + 10 * i, seed=30 + i) for i in range(5)]
        handles = [engine.submit(Request(prompt_ids=p, sampling=SamplingParams(
            max_new_tokens=40, temperature=0, ignore_eos=True))) for p in prompts]
        for p, handle in zip(prompts, handles):
            assert handle.result().token_ids == expected(gemma3, p, 40)
        assert engine.scheduler.preempted >= 2  # two of the five waited for a ring
        assert engine.session.precision == Precision.FP16  # Auto: a lower precision frees no ring
        assert engine.kvpool.rings.available() == RING * LOCAL_RINGS
    finally:
        engine.close()


def test_bench_window_prints_one_json_document_of_the_rings(capsys):
    from kvchat.bench import window

    window.report(window.bench_window(turns=2, prompt_tokens=300, reply_tokens=20), as_json=True)
    r = json.loads(capsys.readouterr().out)
    assert (r["window"], r["windowed_layers"], r["bar_tokens"]) == (WINDOW, 5, WINDOW + BS)
    first, second = r["turns"]
    assert first["ring_tokens"] == second["ring_tokens"] == RING * BS
    assert second["cached_tokens"] == first["chat_tokens"]
    # 5 layers x 2 (K, V) x 2 KV heads x 64 x 4 bytes (fp32 on the CPU) = 5 KiB a token
    assert second["ring_bytes"] == RING * BS * 5120
    assert second["whole_context_bytes"] == second["chat_tokens"] * 5120


GEMMA_2_9B = {"model_type": "gemma2", "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 256, "hidden_size": 3584, "intermediate_size": 14336, "vocab_size": 256000,
              "sliding_window": 4096, "tie_word_embeddings": True}


def test_the_planner_counts_gemma_2s_windowed_layers_at_their_rings():
    """On a 24 GiB card at 32k, Gemma-2-9B's 21 windowed layers take three rings of 257 blocks, not
    32k tokens: Auto picks int8, where counting every layer at the context needed int4."""
    from kvchat.core.memory import format_plan, plan

    p = plan(GEMMA_2_9B, 24 * 2**30, 32768)
    assert p.auto == "int8"
    assert p.ring_bytes["fp16"] == 21 * 3 * 257 * BS * 8192 and p.bytes_per_token["fp16"] == 21 * 8192
    assert "MiB of windowed layers" in format_plan(p)
    plain = plan({k: v for k, v in GEMMA_2_9B.items() if k != "sliding_window"}, 24 * 2**30, 32768)
    assert plain.auto == "int4" and plain.bytes_per_token["fp16"] == 42 * 8192 and not any(plain.ring_bytes.values())


def test_a_context_change_decides_the_rings_again(gemma3, tokenizer):
    """From 4,096 tokens (rings: three of 5 blocks take less than 320 whole blocks) to 96 (8
    blocks: rings would take more) and back: the pool drops and makes its rings between replies,
    and a chat after each change says what transformers says."""
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(gemma3, tokenizer))
    try:
        ids = prompt(70, seed=40)
        assert chat(engine, ids, 20).token_ids == expected(gemma3, ids, 20)
        assert engine.kvpool.rings is not None
        engine.reconfigure(max_context=96).result()
        assert engine.kvpool.rings is None and not engine.kvpool.kv.local
        assert chat(engine, ids, 20).token_ids == expected(gemma3, ids, 20)
        engine.reconfigure(max_context=4096).result()
        assert engine.kvpool.rings is not None and engine.kvpool.kv.local == frozenset(range(5))
        long = prompt(300, seed=41)
        assert chat(engine, long, 20).token_ids == expected(gemma3, long, 20)
    finally:
        engine.close()


@torch.inference_mode()
def test_a_step_that_fails_part_way_keeps_no_ring_for_the_next_turn(gemma3):
    """A chunk that raised after some windowed layers wrote their rows has overwritten rows its
    window still reads: the ring is not kept for the chat's next turn, which computes again."""
    pool = pool_for(gemma3, "fp16")
    seq = Sequence(prompt(300, seed=42))
    pool.manager.reserve(seq, len(seq))
    pool.runner.forward(seq, 200, want_logits=False)
    real = pool.kv.attend

    def third_layer_fails(layer, *args, **kwargs):
        if layer == 3:
            raise torch.OutOfMemoryError("no memory")
        return real(layer, *args, **kwargs)

    pool.kv.attend = third_layer_fails
    with pytest.raises(torch.OutOfMemoryError):
        pool.runner.forward(seq, 300, want_logits=False)
    pool.manager.free(seq, keep_tail=True)
    assert not pool.rings.kept and pool.rings.available() == RING * LOCAL_RINGS
    done = Sequence(prompt(300, seed=43))
    pool.kv.attend = real
    pool.manager.reserve(done, len(done))
    pool.runner.forward(done, len(done), want_logits=False)
    pool.manager.free(done, keep_tail=True)
    assert pool.rings.kept  # a whole step's ring is kept


def test_a_budget_below_the_rings_holds_no_tokens_and_says_so(gemma3):
    pool = pool_for(gemma3, "fp16")
    assert pool.tokens_for(Precision.FP16, 1000) == 0
    assert pool.tokens_for(Precision.FP16) == pool.blocks.num_blocks * BS


@torch.inference_mode()
def test_a_ring_taken_over_from_a_longer_chat_keeps_the_longer_ones_newest_rows_in_mind(gemma3):
    """X computes 320 tokens (its newest block, 19, overwrote block 14's ring slot); Y goes on from
    X's ring at 303 tokens and ends at 304, in block 18; Z shares 295 of Y's tokens. Z's window
    reaches back to block 14, whose rows X overwrote: Z computes again, and says what
    transformers says."""
    pool = pool_for(gemma3, "fp16")

    def turn(ids):
        seq = Sequence(list(ids))
        pool.match(seq)
        pool.manager.reserve(seq, len(seq))
        logits = pool.runner.forward(seq, len(seq), want_logits=True)
        pool.manager.commit(seq)
        pool.manager.free(seq, keep_tail=True)
        return seq, logits

    x = prompt(320, seed=50)
    turn(x)
    y, _ = turn(x[:303] + [(x[303] + 1) % 500 + 3])
    assert y.num_computed == 304 and y.hashes  # went on from X's ring
    z_ids = y.token_ids[:295] + [(y.token_ids[295] + 1) % 500 + 3]
    z = Sequence(list(z_ids))
    pool.match(z)
    assert z.num_computed == 0
    pool.manager.reserve(z, len(z))
    logits = pool.runner.forward(z, len(z), want_logits=True)
    assert (logits - gemma3(torch.tensor([z_ids])).logits[0, -1]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("source,target", [([1, 2, 3, 5, 9], [6, 7, 10, 11, 0]),  # four runs
                                           (list(range(0, 20, 2)), list(range(21, 40, 2)))])  # ten: by index
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_a_ring_copy_moves_every_windowed_tensor_as_index_copy_does_and_touches_nothing_else(precision, source,
                                                                                             target):
    """The regenerate's copy of a ring goes in runs of consecutive ids on both sides; here the
    source's 1-2-3 goes to 6-7-10 (the target breaks), and 3-5 to 10-11 (the source breaks); a
    ring in more pieces than MAX_COPY_RUNS goes by index. The result is index_copy's of
    index_select's, the whole-context layer and the other ring blocks as they were."""
    from kvchat.engine.kv.cache import KVCache

    shape = KVShape(num_layers=3, num_kv_heads=2, head_dim=64, windows=(WINDOW, None, WINDOW))
    kv = KVCache(shape, 8, 16, torch.float32, "cpu", precision, local_blocks=40)
    gen = torch.Generator().manual_seed(0)
    for layer in kv.layers:
        for t in layer.values():
            t.copy_(torch.randint(-100, 100, t.shape, generator=gen).to(t.dtype))
    want = [{name: t.clone() for name, t in layer.items()} for layer in kv.layers]
    for i in (0, 2):
        for t in want[i].values():
            t.index_copy_(0, torch.tensor(target), t.index_select(0, torch.tensor(source)))
    before = kv.layers[0]["k"].clone()
    kv.copy_ring(source, target)
    assert sorted(kv.local) == [0, 2] and not torch.equal(before, kv.layers[0]["k"])
    assert all(torch.equal(t, want[i][name]) for i, layer in enumerate(kv.layers) for name, t in layer.items())
