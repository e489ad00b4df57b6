"""``bench capped``'s chat turn: what it times is a cached history plus a few new tokens."""
from pathlib import Path

import torch

from kvchat.bench.capped import NEW, SHORT, chat_turn
from kvchat.bench.decode import random_model
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request


def test_a_chat_turn_computes_only_the_new_tokens_after_a_cached_history():
    lm = random_model(str(Path(__file__).parents[2] / "src/kvchat/bench/shapes/tiny-llama.json"), torch.device("cpu"), torch.float32)
    engine = Engine(EngineConfig(max_context=1024, kv_precision="fp16"), loaded=lm, disk_tier=None)
    engine.wait_ready()
    try:
        prompt = list(range(3, 803))
        engine.submit(Request(prompt_ids=prompt, sampling=SamplingParams(max_new_tokens=1, temperature=0))).result()
        turn = chat_turn(engine, prompt, lm.model.config.vocab_size, repeats=2)
    finally:
        engine.close()
    assert turn["history_tokens"] == 768  # (800 - 20) rounded down to whole blocks of 16
    assert turn["short_tokens"] == SHORT
    assert turn["computed_long"] == turn["computed_short"] == NEW
