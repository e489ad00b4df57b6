"""The windowed layers' rings (engine/kv/rings.py): a long chat with a windowed model holds its
windowed layers' K/V in a ring of window + one block, and says what transformers says."""
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
    return KVPool(lm, BS, precision, pool_bytes(shape, precision, tokens, 4, BS, rings), rings=rings)


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
    assert [layer["k"].shape[0] for layer in pool.kv.layers] == [RING * LOCAL_RINGS] * 5 + [pool.pool.num_blocks]
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
    counted), and the windowed layers never hold more than window + one block of it. A request
    from another chat in between leaves no ring holding the chat's window: its turn is computed
    again, and is still right."""
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
            assert len(pool.rings.kept[1]) == RING  # the ended turn's ring, kept: 80 tokens
        assert len(history) > 2000
        assert cached[0] == 0 and all(n > 300 for n in cached[1:])
        chat(engine, prompt(120, seed=20), 5)  # another chat
        done = chat(engine, history, 20)
        assert done.stats.cached_tokens == 0
        assert done.token_ids == expected(gemma3, history, 20)
    finally:
        engine.close()
