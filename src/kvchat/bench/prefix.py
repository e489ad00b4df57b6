"""``kvchat bench prefix``: what the prefix cache saves a user's first token, per kind of turn."""
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvchat.bench.engine import PERSONA_LINES, USER_TURNS, at_full_speed, machine
from kvchat.core.config import DEFAULT_CONTEXT, EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.model.loading import load


def persona_text(tokenizer, target_tokens: int = 1000) -> str:
    lines, i = [], 0
    while len(tokenizer("\n".join(lines))["input_ids"]) < target_tokens:
        lines.append(f"Rule {i + 1}. {PERSONA_LINES[i % len(PERSONA_LINES)]}")
        i += 1
    return "\n".join(lines)


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
            theirs[turn] = _hf_ttft(hf, engine.session.formatter.encode(messages).token_ids)
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
    engine.session.formatter.encode(messages[:-1] + [{"role": "user", "content": "warm-up"}])
    times = []
    for _ in range(3):
        started = time.perf_counter()
        engine.session.formatter.encode(messages)
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
