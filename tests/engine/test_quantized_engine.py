"""The quantized KV cache end to end on the starter model."""
import pytest
import torch

from kvchat.core.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.bench.evaluate import kl_divergence, perplexity, window_logprobs
from kvchat.engine.model.loading import LoadedModel
from kvchat.engine.kv.disk_tier import DiskTier


# Measured on the first 512 tokens of the GPL-3 text, windows of 256, chunks of 48 (2026-12-04):
# int8 0.0000077, fp8 0.00028, k8v4 0.00055, int4 0.0022 (mean KL, nats; on the first 1,024 tokens
# 0.0000074, 0.00029, 0.00049, 0.0022; int8, k8v4 and int4 without the full-precision sinks and
# newest tokens: 0.00011, 0.0073, 0.032). The bounds are about twice that.
KL_BOUND = {"int8": 0.000013, "fp8": 0.0006, "k8v4": 0.001, "int4": 0.0042}
TEXT = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="module")
def tokens(starter):
    from pathlib import Path

    if not Path(TEXT).is_file():  # a repeated sentence would make every bound below meaningless
        pytest.fail(f"{TEXT} is missing: install Debian's base-files (it ships the GPL-3 text)")
    return starter.tokenizer(Path(TEXT).read_text(), add_special_tokens=False)["input_ids"][:512]


@pytest.fixture(scope="module")
def one_chunk_fp16(engine_model, tokens):
    return [logp for logp, _ in window_logprobs(engine_model, tokens, 256, "fp16", 256)]


@pytest.mark.parametrize("precision", ["int8", "fp8", "k8v4", "int4"])
def test_a_prefill_chunk_attends_to_its_own_tokens_exactly(engine_model, tokens, one_chunk_fp16, precision):
    """A window prefilled as one chunk reads nothing back from the quantized pool: its
    log-probabilities are the fp16 pool's (measured: 6.9e-5 apart, fp32 rounding of the rotation;
    reading the chunk back quantized, as before, put int4 1.8 apart)."""
    ref = one_chunk_fp16
    got = [logp for logp, _ in window_logprobs(engine_model, tokens, 256, precision, 256)]
    assert max((a - b).abs().max().item() for a, b in zip(ref, got)) < 2e-4


@pytest.fixture(scope="module")
def fp16_logprobs(engine_model, tokens):
    return list(window_logprobs(engine_model, tokens, 256, "fp16", 48))


@pytest.mark.parametrize("precision", ["int8", "fp8", "k8v4", "int4"])
def test_next_token_distributions_stay_close_to_fp16(engine_model, tokens, fp16_logprobs, precision):
    result = kl_divergence(engine_model, tokens, 256, precision, chunk=48, reference=fp16_logprobs)
    assert result["positions"] == 2 * 127
    assert result["kl_mean"] <= KL_BOUND[precision], result


def test_perplexity_scores_the_second_half_of_each_window(engine_model, tokens):
    fp16 = perplexity(engine_model, tokens, 256, "fp16")
    int8 = perplexity(engine_model, tokens, 256, "int8")
    assert fp16["scored_tokens"] == 2 * 127
    assert abs(int8["ppl"] / fp16["ppl"] - 1) < 0.005
    assert int8["bytes_fraction_of_fp16"] == pytest.approx((1 + 2 / 32) / 2)


def shared_engine(lm, precision, store=None):
    e = Engine(EngineConfig(max_context=512, kv_precision=precision), loaded=LoadedModel(**vars(lm)),
               disk_tier=store)
    e.wait_ready()
    return e


PERSONA = {"role": "system", "content": "You are a meticulous archivist who answers briefly. " * 8}


def test_int4_engine_chats_reuses_its_prefix_and_restores_from_disk(engine_model, tmp_path):
    messages = [PERSONA, {"role": "user", "content": "What is the capital of France?"}]
    engine = shared_engine(engine_model, "int4", DiskTier(tmp_path))
    first = engine.generate(messages, max_new_tokens=8, temperature=0)
    again = engine.generate(messages, max_new_tokens=8, temperature=0)
    engine.close()
    assert first.stats.kv_precision == "int4" and first.token_ids
    assert again.stats.cached_tokens == again.stats.prompt_tokens - 1  # its partly filled last block too
    assert again.token_ids == first.token_ids
    restarted = shared_engine(engine_model, "int4", DiskTier(tmp_path))
    done = restarted.generate(messages, max_new_tokens=8, temperature=0)
    restarted.close()
    assert done.stats.cached_tokens > 0 and done.token_ids == first.token_ids


def test_precisions_never_share_cached_blocks(engine_model, tmp_path):
    messages = [PERSONA, {"role": "user", "content": "Hello"}]
    int8 = shared_engine(engine_model, "int8", DiskTier(tmp_path))
    int8.generate(messages, max_new_tokens=2, temperature=0)
    int8.close()
    fp16 = shared_engine(engine_model, "fp16", DiskTier(tmp_path))
    done = fp16.generate(messages, max_new_tokens=2, temperature=0)
    fp16.close()
    assert done.stats.cached_tokens == 0  # the int8 file on disk is for another layout


def test_a_sequence_inside_the_window_attends_to_exact_kv(engine_model):
    """Tokens the full-precision window holds are not read quantized: a short int4 sequence, prefilled
    in two chunks and decoded one token, gives the fp16 logits."""
    from kvchat.engine.kv.manager import Sequence
    from kvchat.engine.kv.pool import KVPool

    ids = engine_model.tokenizer("Free software means the users have the freedom to run, copy, distribute and",
                            add_special_tokens=False)["input_ids"]
    logits = {}
    for precision in ("fp16", "int4"):
        pool = KVPool.for_tokens(engine_model, len(ids), precision)
        seq = Sequence(ids)
        pool.manager.reserve(seq, len(ids))
        pool.runner.forward(seq, 6, want_logits=False)
        pool.runner.forward(seq, len(ids) - 1, want_logits=False)
        logits[precision] = pool.runner.forward(seq, len(ids), want_logits=True)
    assert seq.window.rows(0, len(ids))[:2] == (4, 4)  # the sinks 0..3, the ring from 4: every position
    torch.testing.assert_close(logits["int4"], logits["fp16"], atol=2e-3, rtol=1e-3)


def test_a_prefix_hit_takes_its_sinks_from_the_sink_cache(engine_model):
    from kvchat.engine.kv.manager import Sequence
    from kvchat.engine.kv.pool import KVPool

    ids = engine_model.tokenizer("Free software means the users have the freedom to run, copy, distribute, study, "
                            "change and improve the software. " * 3, add_special_tokens=False)["input_ids"]
    pool = KVPool.for_tokens(engine_model, 256, "int4")
    first = Sequence(ids)
    pool.manager.reserve(first, len(ids))
    pool.runner.forward(first, len(ids), want_logits=False)
    pool.manager.commit(first)
    sinks = pool.kv.sink_cache[tuple(ids[:4])]
    pool.manager.free(first)
    again = Sequence(ids + ids[:5])
    assert pool.manager.match_prefix(again) == len(ids) // 16 * 16
    pool.manager.reserve(again, len(again))
    pool.runner.forward(again, len(again), want_logits=False)
    s, start, k, _ = again.window.rows(0, len(again))
    assert (s, start) == (4, len(ids) // 16 * 16)
    torch.testing.assert_close(k[:4], sinks[0][0])


@pytest.mark.parametrize("first, then", [("int4", None), ("int8", "k8v4")])
def test_a_downshift_keeps_the_sinks_and_newest_tokens_of_a_live_sequence_exact(engine_model, first, then):
    """fp16 -> int4 or int8 with a sequence in flight: its window (sinks and newest tokens) is filled
    from the fp16 pool, so a short sequence goes on exactly as if nothing had changed; int8 -> k8v4
    (keys transformed alike) keeps that window."""
    from kvchat.engine.kv.manager import Sequence
    from kvchat.engine.kv.pool import KVPool

    ids = engine_model.tokenizer("Free software means the users have the freedom to run, copy, distribute and",
                            add_special_tokens=False)["input_ids"]
    pool = KVPool.for_tokens(engine_model, 64, "fp16")
    seq = Sequence(ids)
    pool.manager.reserve(seq, len(ids))
    pool.runner.forward(seq, len(ids) - 1, want_logits=False)
    reference = KVPool.for_tokens(engine_model, 64, "fp16")
    ref_seq = Sequence(ids)
    reference.manager.reserve(ref_seq, len(ids))
    reference.runner.forward(ref_seq, len(ids) - 1, want_logits=False)
    want = reference.runner.forward(ref_seq, len(ids), want_logits=True)
    assert pool.rebuild(first, pool.budget, [seq]) and seq.window.rows(0, len(ids) - 1)[:2] == (4, 4)
    window = seq.window
    if then:
        assert pool.rebuild(then, pool.budget, [seq]) and seq.window is window
    torch.testing.assert_close(pool.runner.forward(seq, len(ids), want_logits=True), want, atol=2e-3, rtol=1e-3)


def test_a_persona_restored_from_disk_keeps_its_exact_sinks(engine_model, tmp_path):
    """The persona file carries the full-precision rows of the first tokens, so a restarted app
    attends to them as exactly as a warm one, not to their int4 copies."""
    messages = [PERSONA, {"role": "user", "content": "Name a river."}]
    engine = shared_engine(engine_model, "int4", DiskTier(tmp_path))
    engine.generate(messages, max_new_tokens=2, temperature=0)
    (key, (warm_k, warm_v)), = engine.kvpool.kv.sink_cache.items()
    engine.close()
    restarted = shared_engine(engine_model, "int4", DiskTier(tmp_path))
    done = restarted.generate(messages, max_new_tokens=2, temperature=0)
    restored = restarted.kvpool.kv.sink_cache.get(key)
    restarted.close()
    assert done.stats.cached_tokens > 0 and restored is not None
    assert torch.equal(restored[0], warm_k) and torch.equal(restored[1], warm_v)
