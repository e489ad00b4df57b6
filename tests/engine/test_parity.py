"""The paged engine against transformers' own forward and generate()."""
import copy

import pytest
import torch

from kvchat.engine.kv.block_pool import BlockPool
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.engine.kv.cache import KVCache
from kvchat.core.kv_sizes import KVShape
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.model.runner import ModelRunner

from tiny_models import ARCHS, as_loaded, tiny_model

TOL = 1e-3


def paged_runner(model, num_blocks=64, block_size=16, scramble=True):
    """A runner on a copy of ``model``; with ``scramble`` the free queue is shuffled so block tables
    are not one run of consecutive ids."""
    pool = BlockPool(num_blocks)
    if scramble:
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
        pool.free_queue = type(pool.free_queue)((i, pool.blocks[i]) for i in order)
    mgr = KVCacheManager(pool, block_size, "test")
    kv = KVCache(KVShape.from_config(model.config), num_blocks, block_size, torch.float32, "cpu")
    return ModelRunner(copy.deepcopy(model), kv, mgr), mgr


def prefill(runner, mgr, ids, chunk):
    seq = Sequence(list(ids))
    mgr.reserve(seq, len(seq))
    logits = None
    while seq.num_computed < len(seq):
        end = min(seq.num_computed + chunk, len(seq))
        logits = runner.forward(seq, end, want_logits=end == len(seq))
    return seq, logits


def assert_decode_matches(model, runner, mgr, seq, logits, steps):
    """Greedy decode ``steps`` tokens through the pool; the last logits equal a full forward's."""
    for _ in range(steps):
        seq.token_ids.append(int(logits.argmax()))
        mgr.reserve(seq, len(seq))
        logits = runner.forward(seq, len(seq), want_logits=True)
    expected = model(torch.tensor([seq.token_ids])).logits[0, -1]
    assert (logits - expected).abs().max().item() <= TOL


def prompt(n=45, seed=0):
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("chunk", [512, 7, 16])
@torch.inference_mode()
def test_prefill_logits_match_transformers(model, chunk):
    ids = prompt()
    runner, mgr = paged_runner(model)
    _, logits = prefill(runner, mgr, ids, chunk)
    expected = model(torch.tensor([ids])).logits[0, -1]
    assert (logits - expected).abs().max().item() <= TOL


@torch.inference_mode()
def test_logits_after_50_decode_steps_match_transformers(model):
    ids = prompt(30)
    runner, mgr = paged_runner(model)
    seq, logits = prefill(runner, mgr, ids, 11)
    assert_decode_matches(model, runner, mgr, seq, logits, steps=50)


def test_greedy_tokens_match_generate(model, tokenizer):
    ids = prompt(20, seed=3)
    expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0)[0, len(ids):]
    engine = Engine(EngineConfig(max_context=256, prefill_chunk=8), loaded=as_loaded(model, tokenizer))
    done = engine.submit(Request(prompt_ids=ids, sampling=SamplingParams(
        max_new_tokens=64, temperature=0, ignore_eos=True))).result()
    engine.close()
    assert done.token_ids == expected.tolist()


@torch.inference_mode()
def test_starter_model_parity(starter):
    model = starter.model
    ids = starter.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    runner, mgr = paged_runner(model, num_blocks=32)
    seq, logits = prefill(runner, mgr, ids, 13)
    expected = model(torch.tensor([ids])).logits[0, -1]
    assert (logits - expected).abs().max().item() <= TOL
    assert_decode_matches(model, runner, mgr, seq, logits, steps=50)


def test_starter_greedy_matches_generate(starter):
    ids = starter.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me about the moon."}],
                                                add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    expected = starter.model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                      max_new_tokens=64, min_new_tokens=64, do_sample=False)[0, len(ids):]
    engine = Engine(EngineConfig(max_context=512), loaded=as_loaded(starter.model, starter.tokenizer, "starter"))
    done = engine.submit(Request(prompt_ids=ids, sampling=SamplingParams(
        max_new_tokens=64, temperature=0, ignore_eos=True))).result()
    engine.close()
    assert done.token_ids == expected.tolist()
