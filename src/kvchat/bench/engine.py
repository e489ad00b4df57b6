"""``kvchat bench``: figures side by side in one process, printed, never asserted."""
import json
import platform
import sys
import statistics
import time

import torch

from kvchat.core.config import DEFAULT_CONTEXT, LADDER, EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.core.events import Request
from kvchat.engine.model.loading import load


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def at_full_speed(engine: Engine, timeout: float = 900) -> None:
    """Until the decode step runs compiled for the pool (it compiles in the background while
    replies decode eagerly), or is known not to: a bench times what a user gets once it is ready."""
    pool = engine.kvpool
    pool.runner.step.prepare(pool.kv)
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


def persona_text(tokenizer, target_tokens: int = 1000) -> str:
    lines, i = [], 0
    while len(tokenizer("\n".join(lines))["input_ids"]) < target_tokens:
        lines.append(f"Rule {i + 1}. {PERSONA_LINES[i % len(PERSONA_LINES)]}")
        i += 1
    return "\n".join(lines)


USER_TURNS = [
    "Where can I find books about the history of the harbour and its old fishing fleet, please?",
    "Do you have anything on lighthouses along this coast, ideally with photographs or maps?",
    "What time does the library open on Saturday, and is the reading room open then too?",
    "Could you suggest a novel set by the sea for a long train journey next weekend?",
]


# (d)'s new turns: each one new text, as a user's next message is (no shared prefix beyond the
# chat template), so each turn computes the whole message against the cached history
NEW_TURNS = [
    "Thank you. Is there a photocopier on the ground floor?",
    "Can I renew my loans by telephone, or only at the desk?",
    "Are dogs allowed in the garden reading area in summer?",
    "How much does a replacement library card cost these days?",
    "Do you keep back issues of the local newspaper from the sixties?",
]


def _ttft(engine, messages, max_new_tokens=1) -> tuple[float, object]:
    done = engine.submit(Request(messages=messages, sampling=SamplingParams(
        max_new_tokens=max_new_tokens, temperature=0))).result()
    return done.stats.ttft_ms, done


@torch.inference_mode()
def _hf_ttft(model, ids: list[int]) -> float:
    t0 = time.perf_counter()
    model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                   max_new_tokens=1, do_sample=False, pad_token_id=0)
    return (time.perf_counter() - t0) * 1000


def bench_prefix(model: str = "starter", turns: int = 20) -> dict:
    import tempfile
    from pathlib import Path

    from kvchat.engine.kv.disk_tier import DiskTier

    store_dir = Path(tempfile.mkdtemp(prefix="kvchat-bench-"))
    engine = Engine(EngineConfig(model=model, max_context=4096), disk_tier=DiskTier(store_dir))
    engine.wait_ready()
    at_full_speed(engine)
    tok = engine.loaded.tokenizer
    persona = {"role": "system", "content": persona_text(tok)}
    engine.generate([{"role": "user", "content": "warm-up"}], max_new_tokens=2, temperature=0)
    question = "Which shelf holds the tide tables for this year, and can I borrow them?"
    cold, first = _ttft(engine, [persona, {"role": "user", "content": question}])
    warm, second = _ttft(engine, [persona, {"role": "user", "content": question.replace("this", "next")}])
    result = {"machine": machine(), "model": model,
              "persona_tokens": first.stats.prompt_tokens, "a_cold_ttft_ms": cold, "a_warm_ttft_ms": warm,
              "a_warm_cached_tokens": second.stats.cached_tokens, "a_ratio": warm / cold}

    hf = load(model).model
    messages, ours, theirs = [], {}, {}
    for turn in range(1, turns + 1):
        messages.append({"role": "user", "content": USER_TURNS[turn % len(USER_TURNS)] + f" (question {turn})"})
        if turn in (2, turns):
            theirs[turn] = _hf_ttft(hf, engine.formatter.encode(messages).token_ids)
        ttft, done = _ttft(engine, messages, max_new_tokens=40)
        ours[turn] = (ttft, done.stats)
        messages.append({"role": "assistant", "content": done.text, "token_ids": done.token_ids})
    result.update({
        "b_turns": turns, "b_prompt_tokens_last": ours[turns][1].prompt_tokens,
        "b_cached_tokens_last": ours[turns][1].cached_tokens,
        "b_ttft_turn2_ms": ours[2][0], "b_ttft_last_ms": ours[turns][0], "b_ratio": ours[turns][0] / ours[2][0],
        "b_transformers_ttft_turn2_ms": theirs[2], "b_transformers_ttft_last_ms": theirs[turns],
        "b_transformers_ratio": theirs[turns] / theirs[2],
    })
    engine.close()

    restarted = Engine(EngineConfig(model=model, max_context=4096), disk_tier=DiskTier(store_dir))
    restarted.wait_ready()
    at_full_speed(restarted)
    restarted.generate([{"role": "user", "content": "warm-up"}], max_new_tokens=2, temperature=0)
    # a question not asked before: the disk tier holds every turn, and (c) is the persona's restore
    again, third = _ttft(restarted, [persona, {"role": "user", "content": question.replace("this", "last")}])
    restarted.close()
    result.update({"c_restart_ttft_ms": again, "c_restart_cached_tokens": third.stats.cached_tokens,
                   "c_ratio": again / cold})
    result.update(bench_long_chat(model))
    result.update(bench_long_chat(model, precision="int8", prefix="d_int8_"))
    return result


def long_chat(n: int) -> list[dict]:
    """``n`` messages of a librarian chat, user and assistant in turn."""
    out = []
    for i in range(n // 2):
        out.append({"role": "user", "content": USER_TURNS[i % len(USER_TURNS)] + f" (question {i})"})
        out.append({"role": "assistant", "content": f"Shelf {i % 9}, row {i % 5}: the harbour books are there, "
                                                    "with the old maps in the cabinet beside them."})
    return out


def bench_long_chat(model: str = "starter", lengths=(2, 200), repeats: int = 5, precision: str = "fp16",
                    prefix: str = "d_") -> dict:
    """(d) TTFT of a new turn after ``n`` messages whose prefix is cached: what is left is the
    prompt's encoding, the prefix match and the uncached tail (the new message), whose attention
    over the cached context is the one cost that grows with the chat. Both chats are cached in the
    one pool and their turns taken in turn, so that a machine busy with something else for a while
    slows both alike, not one of the two medians."""
    engine = Engine(EngineConfig(model=model, max_context=DEFAULT_CONTEXT, kv_precision=precision), disk_tier=None)
    engine.wait_ready()
    histories = {n: long_chat(n) for n in lengths}
    for history in histories.values():
        _ttft(engine, history + [{"role": "user", "content": "Thank you."}])  # computes the whole history
    runs = {n: [] for n in lengths}
    for r in range(repeats):
        question = {"role": "user", "content": NEW_TURNS[r % len(NEW_TURNS)]}
        for n, history in histories.items():
            runs[n].append(_ttft(engine, history + [question]))
    out = {n: (statistics.median(t for t, _ in runs[n]), runs[n][-1][1].stats,
               _encode_ms(engine, histories[n] + [{"role": "user", "content": NEW_TURNS[-1]}])) for n in lengths}
    engine.close()
    short, long_ = lengths
    computed = lambda n: out[n][1].prompt_tokens - out[n][1].cached_tokens
    return {prefix + k: v for k, v in {
        "precision": precision, "messages": long_, "prompt_tokens": out[long_][1].prompt_tokens,
        "cached_tokens": out[long_][1].cached_tokens, "computed_short": computed(short),
        "computed_long": computed(long_), "ttft_short_ms": out[short][0], "ttft_long_ms": out[long_][0],
        "ratio": out[long_][0] / out[short][0], "encode_short_ms": out[short][2],
        "encode_long_ms": out[long_][2]}.items()}


def _encode_ms(engine, messages: list[dict]) -> float:
    """The prompt encoding's share of a turn (in TTFT), once the earlier messages were seen: best
    of 3. Run here while the engine is idle, on its own formatter."""
    engine.formatter.encode(messages[:-1] + [{"role": "user", "content": "warm-up"}])
    times = []
    for _ in range(3):
        started = time.perf_counter()
        engine.formatter.encode(messages)
        times.append((time.perf_counter() - started) * 1000)
    return min(times)


def report_prefix(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"machine: {r['machine']}")
    print(f"(a) persona of {r['persona_tokens']} prompt tokens, then a short message")
    print(f"    TTFT cold {r['a_cold_ttft_ms']:.0f} ms, warm {r['a_warm_ttft_ms']:.0f} ms "
          f"({r['a_warm_cached_tokens']} cached)   warm/cold {r['a_ratio']:.3f}  (target <= 0.15)")
    print(f"(b) {r['b_turns']}-turn conversation, last prompt {r['b_prompt_tokens_last']} tokens "
          f"({r['b_cached_tokens_last']} cached)")
    print(f"    kvchat       TTFT turn 2 {r['b_ttft_turn2_ms']:.0f} ms, turn {r['b_turns']} "
          f"{r['b_ttft_last_ms']:.0f} ms   ratio {r['b_ratio']:.2f}  (target <= 1.5)")
    print(f"    transformers TTFT turn 2 {r['b_transformers_ttft_turn2_ms']:.0f} ms, turn {r['b_turns']} "
          f"{r['b_transformers_ttft_last_ms']:.0f} ms   ratio {r['b_transformers_ratio']:.2f}")
    print(f"(c) restart with the disk cache: TTFT {r['c_restart_ttft_ms']:.0f} ms "
          f"({r['c_restart_cached_tokens']} cached)   restart/cold {r['c_ratio']:.3f}  (target <= 0.3)")
    for p in ("d_", "d_int8_"):
        d = {k[len(p):]: v for k, v in r.items() if k.startswith(p)}
        print(f"(d) a new turn after {d['messages']} messages, {d['precision']} KV ({d['prompt_tokens']} prompt tokens, "
              f"{d['cached_tokens']} cached, {d['computed_long']} computed): TTFT {d['ttft_long_ms']:.0f} ms against "
              f"{d['ttft_short_ms']:.0f} ms after 2 ({d['computed_short']} computed)   ratio {d['ratio']:.2f}  "
              f"(target <= 1.5); prompt encoding {d['encode_long_ms']:.1f} ms against {d['encode_short_ms']:.1f} ms")


def bench_kv(model: str = "starter", prompt_len: int = 512, new_tokens: int = 128, repeats: int = 3) -> dict:
    """Decode speed of the engine per KV precision, same model copy, prompts and threads."""
    lm = load(model)
    rows = {}
    for precision in (p.value for p in LADDER):
        engine = Engine(EngineConfig(model=model, kv_precision=precision, max_context=prompt_len + new_tokens + 64),
                        loaded=lm, disk_tier=None)
        engine.wait_ready()
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
        prompt_len = len(engine.formatter.encode(messages).token_ids)
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
            prompt = engine.formatter.encode(messages).token_ids
            shifts[-1].update(precision=engine.precision.value,
                              reply_kl_mean=reply_kl(lm, engine.kvpool, prompt, last.token_ids)["kl_mean"])
        messages.append({"role": "assistant", "content": last.text, "token_ids": last.token_ids})
        if final:
            break
    prompt = engine.formatter.encode(messages[:-1]).token_ids
    final = engine.precision.value
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
