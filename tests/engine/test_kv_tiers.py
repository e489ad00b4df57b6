"""The KV tiers under the pool (host RAM, disk) on the starter: a conversation pushed out of the
pool, or out of a closed engine, comes back from them with the greedy tokens of a pool that never
lost it, in every precision."""
import random

import pytest

from kvchat.core.config import EngineConfig
from kvchat.core.events import Request
from kvchat.core.config import SamplingParams
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.engine.engine import Engine
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.model.loading import LoadedModel

GEN = 16
# 241 prompt tokens + 16 generated, less the last one (never computed): 256, sixteen full blocks
# and no partly filled one, so the pool's and the tiers' matches end at the same token
A = random.Random(1).choices(range(100, 10000), k=241)
OTHERS = [random.Random(seed).choices(range(100, 10000), k=300) for seed in (2, 3)]
QUESTION = random.Random(4).choices(range(100, 10000), k=20)


def engine(lm, precision: str, pool_tokens: int, ram=None, disk=None) -> Engine:
    per_token = bytes_per_token(KVShape.from_config(lm.model.config), precision, lm.dtype.itemsize)
    config = EngineConfig(max_context=1024, kv_precision=precision, kv_budget_bytes=int(pool_tokens * per_token),
                          ram_cache_bytes=ram, disk_cache_bytes=0 if disk is None else 1 << 30)
    e = Engine(config, loaded=LoadedModel(**vars(lm)), persona_store=None, disk_tier=disk or False)
    e.wait_ready()
    return e


def ask(e: Engine, ids: list[int]):
    sampling = SamplingParams(max_new_tokens=GEN, temperature=0, ignore_eos=True)
    return e.submit(Request(prompt_ids=list(ids), sampling=sampling)).result()


def script(e: Engine, others=OTHERS):
    """A conversation, others that push it out of a small pool, then its next turn."""
    first = ask(e, A)
    for ids in others:
        ask(e, ids)
    return ask(e, A + first.token_ids + QUESTION)


@pytest.mark.parametrize("precision", ["fp16", "int8", "k8v4", "int4"])
def test_a_conversation_pushed_out_of_the_pool_comes_back_from_ram(engine_model, precision):
    reference = engine(engine_model, precision, 4096, ram=0)  # nothing evicted: the pool holds it all
    tiered = engine(engine_model, precision, 384, ram=1 << 30)  # 24 blocks: the others evict the conversation
    try:
        want, got = script(reference), script(tiered)
    finally:
        reference.close()
        tiered.close()
    assert want.stats.cached_tokens == want.stats.pool_tokens == 256
    assert got.stats.cached_tokens == 256 and got.stats.ram_tokens > 0 and got.stats.disk_tokens == 0
    assert got.token_ids == want.token_ids


def test_without_tiers_the_same_conversation_is_computed_again(engine_model):
    """The scenario above evicts: with the tiers off, nothing of the conversation is left."""
    e = engine(engine_model, "fp16", 384, ram=0)
    try:
        done = script(e)
    finally:
        e.close()
    assert done.stats.cached_tokens == 0
