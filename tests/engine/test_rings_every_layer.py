"""A model whose every layer has a window (Mistral 7B v0.1, Phi-3-mini): all its K/V in rings, its
block ids holding no bytes, so its memory stops growing at three rings whatever the context."""
import pytest
import torch

from kvchat.bench.decode import IdTokenizer
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.core.events import Request
from kvchat.core.kv_sizes import LOCAL_RINGS, KVShape, pool_blocks, pool_bytes, ring_blocks
from kvchat.engine.engine import Engine
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool
from kvchat.core.memory_policy import MemoryPolicy, Preempt

from test_parity import prompt
from test_rings import BS, RING, chat, expected, run
from tiny_models import as_loaded, tiny_model

MISTRAL_7B_V01 = {"model_type": "mistral", "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 4096, "intermediate_size": 14336,
                  "vocab_size": 32000, "sliding_window": 4096, "max_position_embeddings": 32768}


@pytest.fixture(scope="module")
def mistral():
    return tiny_model("mistral-window", max_position_embeddings=4096)


def ring_pool(model, precision="fp16", tokens=2048, span=2048, rings=True, **kw) -> KVPool:
    """A pool of ``tokens`` for ``model``, its windowed layers in rings (or not), ids for ``span``."""
    shape = KVShape.from_config(model.config)
    return KVPool(as_loaded(model, IdTokenizer(512)), BS, precision, pool_bytes(shape, precision, tokens, 4, BS, rings),
                  local_blocks=None if rings else 0, span=span, **kw)


def end_turn(pool, ids) -> None:
    """A request of ``ids`` matched, computed and ended as the engine leaves one: blocks cached, ring kept."""
    seq = Sequence(list(ids))
    pool.match(seq)
    pool.manager.reserve(seq, len(seq))
    pool.runner.forward(seq, len(seq), want_logits=False)
    pool.manager.commit(seq)
    pool.manager.free(seq, keep_tail=True)


def test_mistral_v01s_kv_at_32k_is_three_rings_of_its_window():
    """32 layers, 8 KV heads of 128, a 4,096 window on each: at fp16 a token of one layer is
    2 x 8 x 128 x 2 = 4 KiB, and three rings of 257 blocks hold it all. Its block ids hold no
    bytes: the context the pool serves (its span) decides how many; without a span it keeps the
    whole context, as before."""
    shape = KVShape.from_config(MISTRAL_7B_V01)
    assert ring_blocks(shape, BS) == 257
    rings = 32 * LOCAL_RINGS * 257 * BS * 4096
    assert pool_bytes(shape, Precision.FP16, 32768, 2, BS) == rings
    # ids for each ring's sequence to run the whole span
    assert pool_blocks(shape, Precision.FP16, BS, rings, 2, span=32768) == (LOCAL_RINGS * 2048, LOCAL_RINGS * 257)
    assert pool_blocks(shape, Precision.FP16, BS, rings - 1, 2, LOCAL_RINGS * 257, span=32768)[0] == 0
    assert pool_blocks(shape, Precision.FP16, BS, rings, 2) == (rings // (32 * BS * 4096), 0)
    # Phi-3-mini-4k: 2,047 on each of 32 layers at 4k: three rings of 129 blocks take more than 256 whole ones
    phi3 = KVShape(32, 32, 96, (2047,) * 32)
    assert pool_bytes(phi3, Precision.FP16, 4096, 2, BS) == pool_bytes(phi3, Precision.FP16, 4096, 2, BS, rings=False)


def test_the_planner_gives_mistral_v01_fp16_at_32k_on_20_gib():
    """1.5 GiB of rings where the whole context would take 5 GiB with its prefix reserve: fp16 fits
    in 20 GiB beside the 14.5 GB of bf16 weights, where counting every token needed int8."""
    from kvchat.core.memory import format_plan, plan

    p = plan(MISTRAL_7B_V01, 20 * 2**30, 32768)
    assert p.auto == "fp16" and p.ring_bytes["fp16"] == 32 * LOCAL_RINGS * 257 * BS * 4096
    assert p.bytes_per_token["fp16"] == 0 and "MiB of windowed layers" in format_plan(p)
    plain = plan({k: v for k, v in MISTRAL_7B_V01.items() if k != "sliding_window"}, 20 * 2**30, 32768)
    assert plain.auto == "int8"


@pytest.mark.parametrize("precision", ["fp16", "int8"])
@torch.inference_mode()
def test_a_pool_wholly_in_rings_says_what_the_whole_pool_says(mistral, precision):
    """A 600-token prompt in 512-token chunks, then 100 greedy steps: the logits of a pool that keeps
    every row (fp16 exactly; int8 within its rounding, where the ring's chunk reads its window in
    full precision), in three rings of 5 blocks and no whole-context bytes."""
    whole, pool = ring_pool(mistral, precision, rings=False), ring_pool(mistral, precision)
    assert pool.kv.whole() == [] and pool.local_blocks == LOCAL_RINGS * RING and pool.blocks.num_blocks == LOCAL_RINGS * 2048 // BS
    assert pool.kv.nbytes * 8 < whole.kv.nbytes
    ids = prompt(600, seed=5)
    expect, _ = run(whole, ids, 512, 100)
    got, held = run(pool, ids, 512, 100)
    assert held == RING
    assert (got - expect).abs().max().item() <= (1e-5 if precision == "fp16" else 4e-3)


@torch.inference_mode()
def test_block_ids_reused_past_the_span_keep_nothing_in_the_tiers(mistral, caplog):
    """Ids are reused once the span's are taken: the evicted ones' rows are not in any whole-context
    layer, so the RAM tier keeps nothing of them, and says nothing."""
    pool = ring_pool(mistral, span=160, host_cap=2**24)
    assert pool.blocks.on_evict is not None and pool.tiers.idle
    evicted, hook = [], pool.blocks.on_evict
    pool.blocks.on_evict = lambda block: (evicted.append(block.id), hook(block))
    for seed in range(5):  # 5 x 150 tokens in 30 ids: from the fourth on, a request evicts cached blocks
        end_turn(pool, prompt(150, seed=seed))
    assert len(evicted) >= 10 and pool.tiers.usage()["ram_used"] == 0 and not pool.tiers.host.entries
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


def test_a_chat_with_every_layer_windowed_goes_on_from_its_ring(mistral, tokenizer):
    """Three turns to 1,300 tokens through the engine: transformers' greedy replies, each turn
    from the last one's ring (its tokens counted cached), the pool's bytes its three rings. A
    context too short for rings to pay keeps every row, and rings come back with a long one."""
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(mistral, tokenizer))
    try:
        engine.wait_ready()
        pool = engine.kvpool
        per_block = 2 * BS * 2 * 64 * 4  # K and V, 2 KV heads of 64, fp32
        assert pool.kv.whole() == [] and pool.kv.nbytes == 2 * LOCAL_RINGS * RING * per_block
        disk = pool.usage()["tiers"]["disk_used"]  # the test session's disk tier: other tests' blocks too
        history, cached = prompt(400, seed=7), []
        for turn in range(3):
            done = chat(engine, history, 40)
            assert done.token_ids == expected(mistral, history, 40)
            cached.append(done.stats.cached_tokens)
            history = history + done.token_ids + prompt(400, seed=10 + turn)
        assert cached[0] == 0 and all(n > 400 for n in cached[1:])
        assert engine.kvpool.usage()["tiers"]["disk_used"] == disk  # nothing of a whole-context layer to keep
        engine.reconfigure(max_context=96).result()
        assert engine.kvpool.rings is None and engine.kvpool.kv.whole() == [0, 1]
        short = prompt(60, seed=30)
        assert chat(engine, short, 20).token_ids == expected(mistral, short, 20)
        engine.reconfigure(max_context=4096).result()
        assert engine.kvpool.kv.whole() == [] and engine.kvpool.blocks.num_blocks >= 4096 // BS
        assert chat(engine, history, 20).token_ids == expected(mistral, history, 20)
    finally:
        engine.close()


@torch.inference_mode()
def test_a_prompt_longer_than_the_ring_leaves_its_sinks_in_the_sink_cache(mistral):
    """A 600-token chunk writes only its newest rows to a ring; its first tokens' full-precision
    sink rows go to the sink cache all the same, as a whole pool's do (the next chat that opens
    the same way reads them instead of their rounded rows)."""
    ids = prompt(600, seed=5)
    sinks = []
    for rings in (False, True):
        pool = ring_pool(mistral, "int8", rings=rings)
        assert (pool.rings is not None) == rings
        run(pool, ids, 1024, 1)
        sinks.append(pool.kv.sink_cache.get(tuple(ids[:4])))
    assert sinks[1] is not None
    # the same rows transformed alone rather than with the chunk's other 596: fp32 rounding (2.4e-7 here)
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(*sinks))


def test_a_regenerate_goes_on_from_the_copy_of_its_prompts_ring(mistral):
    """A 60-token reply overwrites the ring its 300-token prompt left, so a regenerate of that
    prompt had to compute it all again. The ring is copied when the prompt is done: the regenerate
    takes the copy over (299 tokens cached) and says what transformers says; the copy is made
    only into free ring blocks, and is the first kept ring to go."""
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(mistral, IdTokenizer(512)))
    try:
        ids = prompt(300, seed=3)
        assert chat(engine, ids, 60).stats.cached_tokens == 0
        rings = engine.kvpool.rings
        assert [len(tokens) for tokens, _, _ in rings.kept] == [300, 359]  # the copy, then the ended reply's
        again = chat(engine, ids, 30)
        assert again.stats.cached_tokens == 299 and again.token_ids == expected(mistral, ids, 30)
        assert [len(tokens) for tokens, _, _ in rings.kept] == [300, 359, 329]  # its own copy: the ring was free
        for seed in (1, 2):  # two other chats, no free ring: the first takes the copy, the second the oldest reply's
            chat(engine, prompt(100, seed=seed), 5)
        assert [len(tokens) for tokens, _, _ in rings.kept] == [329, 104, 104]  # and they made no copy
        assert rings.copied is None
    finally:
        engine.close()


def test_a_reply_of_one_token_keeps_its_ring_once(mistral):
    """A reply that ends at its first token computes nothing past its prompt: the prompt's copy
    and the ended ring hold the same rows, and both were kept (two rings of three). The copy goes
    back now; a regenerate still goes on from the ring, as transformers says."""
    engine = Engine(EngineConfig(max_context=4096), loaded=as_loaded(mistral, IdTokenizer(512)))
    try:
        ids = prompt(300, seed=4)
        chat(engine, ids, 1)
        rings = engine.kvpool.rings
        assert [len(tokens) for tokens, _, _ in rings.kept] == [300] and rings.copied is None
        assert len(rings.free) == (LOCAL_RINGS - 1) * RING
        again = chat(engine, ids, 30)
        assert again.stats.cached_tokens == 299 and again.token_ids == expected(mistral, ids, 30)
    finally:
        engine.close()


@torch.inference_mode()
def test_a_restore_from_ram_takes_no_ring_before_its_own_kept_one_is_found():
    """The tiny Gemma 3 (one whole-context layer) in 20 block ids and three rings: three 150-token
    chats end, every ring kept, the first chat's blocks evicted to RAM by the third. Its next turn
    restores them: the restore's reserve gave the sequence a ring before ``take_over`` looked for
    the kept one, so with none free it took the oldest (that chat's own), and the turn was computed
    again. Now the restore takes no ring: the chat goes on from its own, the other two stay kept,
    and the logits are transformers'."""
    model = tiny_model("gemma3", max_position_embeddings=4096)
    pool = ring_pool(model, tokens=320, host_cap=2**24)
    assert pool.rings is not None and pool.blocks.num_blocks == 20
    chats = [prompt(150, seed=seed) for seed in range(3)]
    for ids in chats:
        end_turn(pool, ids)
    assert not pool.rings.free and [t for t, _, _ in pool.rings.kept] == chats
    again = Sequence(chats[0] + prompt(30, seed=9))
    ram, _ = pool.match(again)
    assert ram > 0 and again.num_computed == 144  # its nine full blocks, some from RAM
    assert [t for t, _, _ in pool.rings.kept] == chats[1:]
    pool.manager.reserve(again, len(again))
    logits = pool.runner.forward(again, len(again), want_logits=True)
    assert (logits - model(torch.tensor([again.token_ids])).logits[0, -1]).abs().max().item() <= 1e-4


@torch.inference_mode()
def test_a_pool_wholly_in_rings_never_steps_down_and_a_failed_copy_loses_no_ring(mistral, monkeypatch, caplog):
    """Its ids hold no bytes, so a lower precision adds none: Auto does not step down for them (it
    went fp16 -> int8 -> int4 and preempted all the same). A prompt's ring copy that fails (out of
    memory) leaves every ring block free and the request going."""
    pool = ring_pool(mistral)
    assert MemoryPolicy(Precision.AUTO, pool.quantizable).when_full(pool.precision, False, pool.kv.whole()) == Preempt()
    seq = Sequence(prompt(100, seed=1))
    pool.manager.reserve(seq, len(seq))
    pool.runner.forward(seq, len(seq), want_logits=False)
    before = pool.rings.available()

    def fails(source, target):
        raise RuntimeError("out of memory")
    monkeypatch.setattr(pool.kv, "copy_ring", fails)
    pool.ring_prefix.prompt_done(seq)
    assert pool.rings.available() == before and not pool.rings.kept and "could not keep a copy" in caplog.text


@pytest.mark.slow
def test_memory_pressure_on_a_pool_wholly_in_rings_that_already_fits_rebuilds_nothing_and_says_nothing(mistral):
    """Its bytes are its rings, whatever the budget: a pool rebuilt under pressure came back the same
    size and said it had shrunk. Its budget is lowered, so the next second does not ask again."""
    from kvchat.core.events import Notice
    from kvchat.core.memory import MemorySnapshot
    from kvchat.engine.memory_probe import ScriptedProbe
    from polling import wait_for

    gib = 1 << 30
    probe = ScriptedProbe(total=8 * gib)
    rings = 2 * LOCAL_RINGS * RING * 2 * BS * 2 * 64 * 4  # 2 layers, K and V, 2 KV heads of 64, fp32
    engine = Engine(EngineConfig(max_context=4096, headroom_bytes=gib, kv_budget_bytes=4 * rings),
                    loaded=as_loaded(mistral, IdTokenizer(512)), probe=probe, disk_tier=None)
    try:
        engine.wait_ready()
        pool, events = engine.kvpool, []
        engine.add_listener(events.append)
        nbytes, kv = pool.kv.nbytes, pool.kv
        assert nbytes == rings and pool.budget == 4 * rings
        allowed = pool.budget // 3  # above the rings
        probe.other = 8 * gib - (engine.session.weights_bytes + engine.session.activations + gib) - allowed
        assert wait_for(lambda: engine.kvpool.budget < 4 * rings, timeout=6)
        seen = sum(isinstance(x, MemorySnapshot) for x in events)
        assert wait_for(lambda: sum(isinstance(x, MemorySnapshot) for x in events) >= seen + 2, timeout=6)
        assert not [x for x in events if isinstance(x, Notice)]
        assert engine.kvpool.kv is kv and kv.nbytes == nbytes and rings <= engine.kvpool.budget <= allowed
    finally:
        engine.close()
