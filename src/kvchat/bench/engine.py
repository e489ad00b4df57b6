"""``kvchat bench``: figures side by side in one process, printed, never asserted."""
import json
import platform
import sys
import statistics
import time

import torch

from kvchat.core.config import ORDER, EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.engine.model.loading import load


def cpu_build(model=None) -> dict:
    """What a CPU speed figure depends on beside the machine: the instruction sets of kvchat's
    kernels, ATen and inductor; the compiler and OpenMP runtime that build the compiled step and
    the kernels; and, given a model, what ran its int8 products."""
    from kvchat.engine import toolchain
    from kvchat.kernels import cpu_isa

    info = {"isa": cpu_isa.describe(), **toolchain.describe()}
    if model is not None:
        info["int8_products"] = int8_products(model)
    return info


def int8_products(model) -> str | None:
    """What ran the int8 and 4-bit weights' products (None: no such weights)."""
    from kvchat.engine.model.kernel_build import build_kernel
    from kvchat.engine.model.weights import Int4Linear, Int8Linear
    from kvchat.kernels import int8_rows

    linears = [m for m in model.modules() if isinstance(m, (Int8Linear, Int4Linear))]
    if not linears:
        return None
    four = [m for m in linears if isinstance(m, Int4Linear)]
    if not any(m.packed for m in linears):
        return "inductor's and torch's (no AVX2 kernel for this CPU, no compiler, or shapes it does not take)"
    build_kernel()  # waits for the load's build: a --paths transformers run never warms up
    if not int8_rows.built:
        return "inductor's (the int8 kernel did not build)"
    bits = "int8 and 4-bit" if four and all(m.packed for m in four) else "int8"
    return f"kvchat's int8_rows kernel, {bits} ({int8_rows.isa}, {int8_rows.origin})"


def describe_cpu_build(info: dict) -> str:
    isa = info["isa"]
    line = (f"ISA: kvchat {isa['kvchat']}, ATen {isa['aten']}, inductor {isa.get('inductor', '?')}; "
            f"compiler {info['compiler']}, OpenMP {info['openmp']}")
    return line + (f"; int8 products: {info['int8_products']}" if info.get("int8_products") else "")


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def at_full_speed(engine: Engine, timeout: float = 900, batch: int = 1) -> None:
    """Until the decode step runs compiled for the pool (it compiles in the background while
    replies decode eagerly), and for batches of up to ``batch`` sequences, or is known not to: a
    bench times what a user gets once it is ready."""
    from kvchat.engine.model.batch_step import BUCKETS, bucket_for

    pool = engine.kvpool
    pool.runner.step.prepare(pool.kv)
    pool.runner.step.background.wait(timeout)
    if batch > 1:
        pool.runner.batch.wanted.update(b for b in BUCKETS if b <= bucket_for(batch))
        pool.runner.batch.prepare(pool.kv)
        pool.runner.step.background.wait(timeout)


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


PERSONA_LINES = [
    "You are Marlowe, the reference librarian of a small coastal town.",
    "You answer in plain English, cite the shelf where a book lives, and admit when you do not know.",
    "You never invent titles; when unsure, you suggest how the reader could check.",
    "Opening hours are nine to five on weekdays and ten to two on Saturdays.",
    "The local history collection sits on the second floor, beside the map cabinet.",
    "Children's books are on the ground floor; the reading hour is Wednesday at four.",
]


USER_TURNS = [
    "Where can I find books about the history of the harbour and its old fishing fleet, please?",
    "Do you have anything on lighthouses along this coast, ideally with photographs or maps?",
    "What time does the library open on Saturday, and is the reading room open then too?",
    "Could you suggest a novel set by the sea for a long train journey next weekend?",
]


def bench_kv(model: str = "starter", prompt_len: int = 512, new_tokens: int = 128, repeats: int = 3) -> dict:
    """Decode speed of the engine per KV precision, same model copy, prompts and threads. The
    first engine loads the model on its own thread (``bench.speculate._engine``: loaded here, the
    engine decoded at half speed on 2 cores)."""
    lm = None
    rows = {}
    for precision in (p.value for p in ORDER):
        engine = Engine(EngineConfig(model=model, kv_precision=precision, max_context=prompt_len + new_tokens + 64),
                        loaded=lm, disk_tier=None)
        engine.wait_ready()
        lm = engine.loaded
        at_full_speed(engine)
        sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
        speeds = []
        for r in range(repeats + 1):
            stats = engine.submit(Request(prompt_ids=random_prompt(prompt_len, lm.model.config.vocab_size, r),
                                          sampling=sp)).result().stats
            if r:
                speeds.append((prompt_len / (stats.ttft_ms / 1000), stats.decode_tok_s))
        engine.close()
        rows[precision] = {"prefill_tok_s": statistics.median(s[0] for s in speeds),
                           "decode_tok_s": statistics.median(s[1] for s in speeds)}
    for row in rows.values():
        row["decode_ratio_vs_fp16"] = row["decode_tok_s"] / rows["fp16"]["decode_tok_s"]
    return {"machine": machine(), "model": model, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
            "precisions": rows}


def report_kv(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(f"machine: {result['machine']}; {result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens")
    for name, row in result["precisions"].items():
        print(f"  {name:<5} prefill {row['prefill_tok_s']:7.1f} tok/s   decode {row['decode_tok_s']:6.1f} tok/s   "
              f"decode vs fp16 {row['decode_ratio_vs_fp16']:.2f}")


def bench_memory(model: str = "starter", pool_tokens: int = 320, growth: float = 5.0, max_turns: int = 60) -> dict:
    """A pool sized for ``pool_tokens`` at fp16 serves, under Auto, a conversation ``growth`` times
    longer; the downshifts are logged and the last reply is scored in the engine's own pool, as its
    conversions left it, by KL divergence against an unconstrained fp16 cache."""
    from kvchat.bench.evaluate import reply_kl
    from kvchat.core.events import Finished, Notice
    from kvchat.core.kv_sizes import KVShape, bytes_per_token

    lm = load(model)
    shape = KVShape.from_config(lm.model.config)
    budget = int(pool_tokens * bytes_per_token(shape, "fp16", lm.dtype.itemsize))  # fp32 on the CPU, bf16 on a GPU
    target = int(pool_tokens * growth)
    engine = Engine(EngineConfig(model=model, kv_precision="auto", kv_budget_bytes=budget,
                                 max_context=int(pool_tokens * (growth + 1))), loaded=lm, disk_tier=None)
    engine.wait_ready()
    persona = {"role": "system", "content": "You are Marlowe, a patient reference librarian. Answer in full sentences."}
    messages, shifts, errors, turn, last = [persona], [], 0, 0, None
    while turn < max_turns:
        turn += 1
        messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)] + f" (question {turn})"})
        prompt_len = len(engine.session.formatter.encode(messages).token_ids)
        final = prompt_len + 48 + 100 >= target  # another exchange might not fit: end on a longer reply
        handle = engine.submit(Request(messages=messages, sampling=SamplingParams(
            max_new_tokens=max(1, target - prompt_len) if final else 48, temperature=0.7, seed=turn,
            ignore_eos=True)))
        done, shifted = None, False
        for event in handle:
            if isinstance(event, Notice) and event.kind == "downshift":
                shifts.append({"turn": turn, "message": event.message})
                shifted = True
            elif isinstance(event, Finished):
                done = last = event
            elif not hasattr(event, "token_id") and not isinstance(event, Notice):
                errors += 1
        if done is None:
            break
        print(f"turn {turn}: {done.stats.prompt_tokens + done.stats.generated_tokens} tokens, "
              f"KV {done.stats.kv_precision}", file=sys.stderr, flush=True)
        if shifted:  # this reply is the first the converted pool served: score it there, now
            prompt = engine.session.formatter.encode(messages).token_ids
            shifts[-1].update(precision=engine.session.precision.value,
                              reply_kl_mean=reply_kl(lm, engine.kvpool, prompt, last.token_ids)["kl_mean"])
        messages.append({"role": "assistant", "content": last.text, "token_ids": last.token_ids})
        if final:
            break
    prompt = engine.session.formatter.encode(messages[:-1]).token_ids
    final = engine.session.precision.value
    reply = last.token_ids
    kl = reply_kl(lm, engine.kvpool, prompt, reply)  # the engine is idle: its pool is read as it is
    engine.close()
    return {"machine": machine(), "model": model, "pool_tokens_at_fp16": pool_tokens, "pool_bytes": budget,
            "turns": turn, "conversation_tokens": last.stats.prompt_tokens + last.stats.generated_tokens,
            "ratio_to_pool": (last.stats.prompt_tokens + last.stats.generated_tokens) / pool_tokens,
            "errors": errors, "trimmed_messages": last.stats.trimmed_messages, "downshifts": shifts,
            "final_precision": final, "last_reply_tokens": len(reply),
            "last_reply_kl_mean": kl["kl_mean"], "last_reply_kl_max": kl["kl_max"]}


def report_memory(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"machine: {r['machine']}")
    print(f"pool: {r['pool_bytes'] / 2**20:.1f} MiB = {r['pool_tokens_at_fp16']} tokens in the fp16 mode (the "
          f"model's dtype: fp32 on the CPU), Auto")
    print(f"conversation: {r['turns']} turns, {r['conversation_tokens']} tokens = {r['ratio_to_pool']:.2f} x the "
          f"fp16 pool, {r['errors']} errors, {r['trimmed_messages']} messages trimmed")
    for s in r["downshifts"]:
        print(f"  turn {s['turn']}: {s['message']}; that turn's reply, scored in the converted pool: KL "
              f"{s['reply_kl_mean']:.5f} nats at {s['precision']}")
    print(f"final precision {r['final_precision']}; last reply ({r['last_reply_tokens']} tokens) in the engine's "
          f"own pool against an unconstrained fp16 cache: KL mean {r['last_reply_kl_mean']:.5f}, "
          f"max {r['last_reply_kl_max']:.5f} nats")


def bench_switch(model: str = "starter") -> dict:
    """Peak resident memory while the engine switches from ``model`` to ``model`` (sampled every
    5 ms) against its steady state; the time from a quit mid-reply to the process being gone."""
    import threading

    import psutil


    proc = psutil.Process()
    config = EngineConfig(model=model)
    engine = Engine(config, disk_tier=None)
    engine.wait_ready()
    at_full_speed(engine)
    engine.generate([{"role": "user", "content": "warm-up"}], max_new_tokens=4, temperature=0)
    steady = proc.memory_info().rss
    samples, stop = [], threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(proc.memory_info().rss)
            time.sleep(0.005)

    sampler = threading.Thread(target=sample)
    sampler.start()
    started = time.perf_counter()
    engine.load_model(config).result()
    switch_s = time.perf_counter() - started
    engine.generate([{"role": "user", "content": "warm-up"}], max_new_tokens=4, temperature=0)
    stop.set()
    sampler.join()
    after = proc.memory_info().rss
    engine.close()
    return {"machine": machine(), "model": model, "steady_rss": steady, "switch_peak_rss": max(samples),
            "after_switch_rss": after, "peak_ratio": max(samples) / steady, "switch_s": switch_s,
            "quit_mid_reply_s": _quit_mid_reply(model)}


QUIT_SCRIPT = """
import sys
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request, TokenDelta
engine = Engine(EngineConfig(model=sys.argv[1]), disk_tier=None)
engine.wait_ready()
handle = engine.submit(Request(messages=[{"role": "user", "content": "Write a long story."}],
                               sampling=SamplingParams(max_new_tokens=2000, temperature=0, ignore_eos=True)))
for n, event in enumerate(e for e in handle if isinstance(e, TokenDelta)):
    if n == 5:
        break
print("streaming", flush=True)
sys.stdin.readline()
engine.close()
"""


def _quit_mid_reply(model: str) -> float:
    """Seconds from "quit" (mid-reply) to the process being gone, interpreter teardown included."""
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", QUIT_SCRIPT, model], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    child.stdout.readline()
    started = time.perf_counter()
    child.stdin.write("quit\n")
    child.stdin.flush()
    child.wait()
    return time.perf_counter() - started


def report_switch(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    mib = lambda n: f"{n / 2**20:,.0f} MiB"
    print(f"machine: {r['machine']}")
    print(f"{r['model']} -> {r['model']}: steady {mib(r['steady_rss'])}, peak during the switch "
          f"{mib(r['switch_peak_rss'])} ({r['peak_ratio']:.2f} x, target <= 1.1), after {mib(r['after_switch_rss'])}, "
          f"switch {r['switch_s']:.1f} s")
    print(f"quit mid-reply: process gone in {r['quit_mid_reply_s']:.2f} s (target <= 3)")
