"""``kvchat bench capped``: long prompts and a forced downshift on a card of a given size.

A 24 GB RTX card is emulated on a larger GPU by capping what this process may allocate
(``torch.cuda.set_per_process_memory_fraction``) and telling the planner the same total. Auto then
plans the pool as it would on that card; a 16k and a 32k prompt are prefilled through the engine,
and the full pool is converted to int8. Printed: out of memory or not, and each phase's peak above
the weights and the pool, against the planner's activations reserve. Between the prompts and the
downshift, a chat's next turn (``chat_turn``): the TTFT of a short new message after a long cached
history against after a short one, ``bench prefix`` (d)'s ratio on this device and shape (token ids:
random weights have no tokenizer). Random weights of a named shape, as ``bench decode
--random-weights``: no download.
"""
import statistics
import sys
import time

import torch

from kvchat.bench.decode import random_model, sync
from kvchat.bench.figures import figure
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.core.memory import GiB
from kvchat.engine.memory_probe import ScriptedProbe
from kvchat.engine.model.loading import pick_device, pick_dtype


def bench_capped(random_weights: str, device: str = "auto", dtype: str = "auto", memory: int = 24 * GiB,
                 prompts: tuple[int, ...] = (16384, 32768)) -> dict:
    dev = pick_device(device)
    if dev.type == "cuda":
        total = torch.cuda.get_device_properties(dev).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, memory / total), dev)
    lm = random_model(random_weights, dev, pick_dtype(dtype, dev))
    # the card holds the weights before any KV: a probe reporting nothing in use let the planner
    # size the pool as if the 8B shape's 15 GiB were free
    weights = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
    engine = Engine(EngineConfig(max_context=max(prompts), kv_precision="auto"), loaded=lm, disk_tier=None,
                    probe=ScriptedProbe(total=memory, own=weights))
    engine.wait_ready()
    base = _allocated(dev)
    result = {"device": str(dev), "shape": random_weights, "memory_gib": memory / GiB,
              "precision": engine.session.precision.value, "pool_gib": engine.kvpool.kv.nbytes / GiB,
              "activations_reserve_gib": engine.session.activations / GiB, "phases": []}
    figure(result)
    vocab = lm.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    for n in prompts:
        ids = torch.randint(3, vocab, (n - 1,), generator=gen).tolist()
        result["phases"].append(_phase(f"prompt {n}", dev, base, lambda: engine.submit(Request(
            prompt_ids=ids, sampling=SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))).result()))
    result["chat_turn"] = chat_turn(engine, ids, vocab)
    figure({"chat_turn": result["chat_turn"]})
    # the pool now holds the prompts' blocks as cached prefixes: converting it touches every one
    result["phases"].append(_phase("downshift to int8", dev, base,
                                   lambda: engine.reconfigure(kv_precision="int8").result()))
    result["precision_after"] = engine.session.precision.value
    engine.close()
    return result


HISTORY, SHORT, NEW = 6016, 96, 20  # bench prefix (d): 200 messages are 6,014 tokens; a new turn 17-20


def chat_turn(engine: Engine, prompt: list[int], vocab: int, repeats: int = 5) -> dict:
    """TTFT of ``NEW`` new tokens after the first ``HISTORY`` tokens of ``prompt`` (cached by its
    prefill) against after its first ``SHORT``, taken in turn, new tokens each time; medians."""
    gen = torch.Generator().manual_seed(1)
    block = engine.config.block_size  # whole blocks: the prefix cache matches no less
    history = min(HISTORY, (len(prompt) - NEW) // block * block)  # within the context: the rehearsal's is short
    runs = {SHORT: [], history: []}
    for _ in range(repeats):
        new = torch.randint(3, vocab, (NEW,), generator=gen).tolist()
        for n in runs:
            stats = engine.submit(Request(prompt_ids=prompt[:n] + new, sampling=SamplingParams(
                max_new_tokens=1, temperature=0, ignore_eos=True))).result().stats
            runs[n].append((stats.ttft_ms, stats.prompt_tokens - stats.cached_tokens))
    short, long_ = (statistics.median(t for t, _ in runs[n]) for n in (SHORT, history))
    return {"history_tokens": history, "short_tokens": SHORT, "computed_long": runs[history][-1][1],
            "computed_short": runs[SHORT][-1][1], "ttft_short_ms": short, "ttft_long_ms": long_,
            "ratio": long_ / short}


def _phase(name: str, dev: torch.device, base: int, run) -> dict:
    print(f"{name} ...", file=sys.stderr, flush=True)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    sync(dev)
    t0 = time.perf_counter()
    row = {"phase": name, "ok": True, "error": None}
    try:
        run()
    except Exception as e:  # an out-of-memory error is the finding, not a crash of the bench
        row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200]}")
    sync(dev)
    row["seconds"] = time.perf_counter() - t0
    if dev.type == "cuda":
        row["peak_above_weights_and_pool_gib"] = (torch.cuda.max_memory_allocated(dev) - base) / GiB
    figure(row)
    return row


def _allocated(dev: torch.device) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0


def report(r: dict, as_json: bool) -> None:
    import json

    if as_json:
        print(json.dumps(r))
        return
    print(f"{r['device']}, {r['shape']}, capped at {r['memory_gib']:.0f} GiB: Auto chose {r['precision']}, pool "
          f"{r['pool_gib']:.2f} GiB, activations reserve {r['activations_reserve_gib']:.2f} GiB")
    for p in r["phases"]:
        peak = p.get("peak_above_weights_and_pool_gib")
        print(f"  {p['phase']:<18} {'ok' if p['ok'] else 'FAILED: ' + p['error']}  {p['seconds']:.1f} s"
              + (f"  peak {peak:.2f} GiB above weights and pool" if peak is not None else ""))
    c = r["chat_turn"]
    print(f"  a chat's next turn (before the downshift): TTFT {c['ttft_long_ms']:.1f} ms after {c['history_tokens']} cached tokens against "
          f"{c['ttft_short_ms']:.1f} ms after {c['short_tokens']} ({c['computed_long']} and {c['computed_short']} "
          f"computed)   ratio {c['ratio']:.2f}  (target <= 1.5)")
    print(f"  precision after: {r['precision_after']}")
