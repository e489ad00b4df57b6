"""The quantized KV cache end to end on the starter model."""
import pytest

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.evaluate import kl_divergence, perplexity
from kvchat.engine.models import LoadedModel
from kvchat.engine.persona_store import PersonaStore

from tiny_models import as_loaded

# Measured on the first 1,024 tokens of the GPL-3 text, windows of 256, chunks of 48:
# int8 0.00011, k8v4 0.0073, int4 0.032 (mean KL, nats). The bounds leave room for other CPUs' rounding.
KL_BOUND = {"int8": 0.001, "k8v4": 0.02, "int4": 0.06}
TEXT = "/usr/share/common-licenses/GPL-3"


@pytest.fixture(scope="module")
def tokens(starter):
    from pathlib import Path

    text = Path(TEXT).read_text() if Path(TEXT).exists() else (
        "The licenses for most software are designed to take away your freedom to share and change it. " * 60)
    return starter.tokenizer(text, add_special_tokens=False)["input_ids"][:1024]


@pytest.mark.parametrize("precision", ["int8", "k8v4", "int4"])
def test_next_token_distributions_stay_close_to_fp16(starter, tokens, precision):
    result = kl_divergence(starter, tokens, 256, precision, chunk=48)
    assert result["positions"] == 4 * 127
    assert result["kl_mean"] <= KL_BOUND[precision], result


def test_perplexity_scores_the_second_half_of_each_window(starter, tokens):
    fp16 = perplexity(starter, tokens, 256, "fp16")
    int8 = perplexity(starter, tokens, 256, "int8")
    assert fp16["scored_tokens"] == 4 * 127
    assert abs(int8["ppl"] / fp16["ppl"] - 1) < 0.005
    assert int8["bytes_fraction_of_fp16"] == pytest.approx((1 + 2 / 32) / 2)


def shared_engine(starter, precision, store=None):
    lm = as_loaded(starter.model, starter.tokenizer, "starter")
    e = Engine(EngineConfig(max_context=512, kv_precision=precision), loaded=LoadedModel(**vars(lm)),
               persona_store=store)
    e.wait_ready()
    return e


PERSONA = {"role": "system", "content": "You are a meticulous archivist who answers briefly. " * 8}


def test_int4_engine_chats_reuses_its_prefix_and_restores_from_disk(starter, tmp_path):
    messages = [PERSONA, {"role": "user", "content": "What is the capital of France?"}]
    engine = shared_engine(starter, "int4", PersonaStore(tmp_path))
    first = engine.generate(messages, max_new_tokens=8, temperature=0)
    again = engine.generate(messages, max_new_tokens=8, temperature=0)
    engine.close()
    assert first.stats.kv_precision == "int4" and first.token_ids
    assert again.stats.cached_tokens == (again.stats.prompt_tokens - 1) // 16 * 16
    assert again.token_ids == first.token_ids
    restarted = shared_engine(starter, "int4", PersonaStore(tmp_path))
    done = restarted.generate(messages, max_new_tokens=8, temperature=0)
    restarted.close()
    assert done.stats.cached_tokens > 0 and done.token_ids == first.token_ids


def test_precisions_never_share_cached_blocks(starter, tmp_path):
    messages = [PERSONA, {"role": "user", "content": "Hello"}]
    int8 = shared_engine(starter, "int8", PersonaStore(tmp_path))
    int8.generate(messages, max_new_tokens=2, temperature=0)
    int8.close()
    fp16 = shared_engine(starter, "fp16", PersonaStore(tmp_path))
    done = fp16.generate(messages, max_new_tokens=2, temperature=0)
    fp16.close()
    assert done.stats.cached_tokens == 0  # the int8 file on disk is for another layout
