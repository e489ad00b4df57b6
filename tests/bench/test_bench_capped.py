"""``bench capped``: the card it emulates, and its chat turn: what it times is a cached history
plus a few new tokens."""
import json
from pathlib import Path

import pytest
import torch

from kvchat.bench import capped
from kvchat.bench.capped import NEW, SHORT, chat_turn
from kvchat.bench.decode import random_model
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.core.memory import GiB

TINY = str(Path(__file__).parents[2] / "src/kvchat/bench/shapes/tiny-llama.json")


def test_the_capped_card_holds_the_weights_before_the_planner_sizes_the_pool(monkeypatch):
    """The engine's probe is the emulated card: of its memory, the weights are in use from the
    start (it said 0 bytes, and the planner gave the pool what the 8B weights hold)."""
    class Built(Exception):
        pass

    def engine(config, loaded, disk_tier, probe):
        made.update(loaded=loaded, probe=probe)
        raise Built  # what the engine was given is all this test reads

    made = {}
    monkeypatch.setattr(capped, "Engine", engine)
    with pytest.raises(Built):
        capped.bench_capped(TINY, "cpu", "float32", memory=2 * GiB, prompts=(256,))
    weights = sum(p.numel() * p.element_size() for p in made["loaded"].model.parameters())
    total, used = made["probe"].totals()
    assert weights > 0 and total == 2 * GiB
    assert used >= weights and made["probe"].own() >= weights


def test_each_phase_is_filed_the_moment_it_ends(tmp_path, monkeypatch):
    """gpu-check's step has a time limit, and the bench's JSON comes only at its end."""
    figures = tmp_path / "results.jsonl"
    monkeypatch.setenv("KVCHAT_FIGURES", str(figures))
    monkeypatch.setenv("KVCHAT_STEP", "capped_24gb")
    row = capped._phase("prompt 16", torch.device("cpu"), 0, lambda: None)
    filed = figures.read_text().splitlines() if figures.exists() else []
    assert [json.loads(line) for line in filed] == [{"step": "capped_24gb", "figure": row}]


def test_a_chat_turn_computes_only_the_new_tokens_after_a_cached_history():
    lm = random_model(TINY, torch.device("cpu"), torch.float32)
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
