"""``kvchat bench window``: a chat with a windowed model, turn by turn: what its windowed layers
hold in their rings (``engine/kv/rings.py``) against what they would hold keeping the whole
context, as the chat grows past 2,000 tokens. A tiny Gemma 3 (five windowed layers of 64 to one
whole-context layer) with random weights unless ``--random-weights`` names another shape."""
import json
from importlib.resources import files

import torch

from kvchat.bench.decode import random_model
from kvchat.bench.engine import machine, random_prompt
from kvchat.core.config import BLOCK_SIZE, EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.core.kv_sizes import KVShape, layer_block_bytes, ring_blocks
from kvchat.engine.engine import Engine


def bench_window(config_path: str | None = None, turns: int = 4, prompt_tokens: int = 450,
                 reply_tokens: int = 60) -> dict:
    path = config_path or str(files("kvchat.bench") / "shapes" / "tiny-gemma3.json")
    lm = random_model(path, torch.device("cpu"), torch.float32)
    shape = KVShape.from_config(lm.model.config)
    local = len(shape.local_layers)
    if not ring_blocks(shape, BLOCK_SIZE):
        raise ValueError(f"{path}: no layer has a window: nothing to put in rings")
    per_token = layer_block_bytes(shape, "fp16", BLOCK_SIZE, lm.dtype.itemsize) / BLOCK_SIZE  # one layer
    vocab = lm.model.config.vocab_size
    engine = Engine(EngineConfig(kv_precision="fp16", max_context=4096), loaded=lm, disk_tier=None)
    rows, history = [], random_prompt(prompt_tokens, vocab, 0)
    try:
        for turn in range(1, turns + 1):
            done = engine.submit(Request(prompt_ids=list(history), sampling=SamplingParams(
                max_new_tokens=reply_tokens, temperature=0, ignore_eos=True))).result()
            pool = engine.kvpool
            held = len(pool.rings.kept[-1][1]) * BLOCK_SIZE if pool.rings.kept else 0  # the chat's ring, kept
            tokens = len(history) + len(done.token_ids) - 1  # the last token's K/V is never written
            rows.append({"turn": turn, "chat_tokens": tokens, "cached_tokens": done.stats.cached_tokens,
                         "ring_tokens": held, "ring_bytes": int(held * local * per_token),
                         "whole_context_bytes": int(tokens * local * per_token)})
            history = history + done.token_ids + random_prompt(prompt_tokens, vocab, turn)
        usage = engine.kvpool.usage()
    finally:
        engine.close()
    window = max(w for w in shape.windows if w)
    return {"machine": machine(), "model": path, "windowed_layers": local, "layers": shape.num_layers,
            "window": window, "block_size": BLOCK_SIZE, "bar_tokens": window + BLOCK_SIZE, "turns": rows,
            "pool_bytes": usage["kv_total"]}


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"machine: {r['machine']}")
    print(f"model: {r['model']}: {r['windowed_layers']} of {r['layers']} layers windowed at {r['window']} tokens; "
          f"the bar: window + one block = {r['bar_tokens']} tokens")
    print(f"{'turn':>4} {'chat tokens':>11} {'cached':>6} {'ring tokens':>11} {'windowed layers':>15} "
          f"{'whole context':>13} {'ratio':>6}")
    for t in r["turns"]:
        print(f"{t['turn']:>4} {t['chat_tokens']:>11,} {t['cached_tokens']:>6,} {t['ring_tokens']:>11,} "
              f"{t['ring_bytes'] / 2**10:>12,.0f} KiB {t['whole_context_bytes'] / 2**10:>10,.0f} KiB "
              f"{t['ring_bytes'] / t['whole_context_bytes']:>6.3f}")
    print(f"the whole pool (every ring and the whole-context layer's blocks): {r['pool_bytes'] / 2**20:.1f} MiB")
