"""``kvchat bench resume``: a long conversation answered again, side by side in one run, cold; after
four other long chats pushed it out of the pool (its blocks come back from RAM); after a restart of
the engine (from disk). TTFT and the prompt tokens computed and restored for each, and the
restore's bytes per second (the tier's lookup, file reads and checks, and the copy into the pool)
against plain reads of the same files. Then what the tiers cost a chat that never leaves the
pool: prefill and decode speed with the tiers on and off, and the disk write after each turn."""
import json
import statistics
import tempfile
import time
from pathlib import Path

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.model.loading import load

from kvchat.bench.engine import PERSONA_LINES, USER_TURNS, at_full_speed, machine

CONTEXT = 8192  # the app's default: the pool holds about 10,000 tokens, fewer than two such chats
REPLY = 32
LINES = PERSONA_LINES + USER_TURNS


def document(tokenizer, tokens: int, seed: int) -> str:
    """A pasted document of about ``tokens`` tokens, different for each ``seed``."""
    lines, i = [], 0
    while len(tokenizer("\n".join(lines))["input_ids"]) < tokens:
        lines.append(f"{seed}.{i}: {LINES[(i * 7 + seed) % len(LINES)]}")
        i += 1
    return "\n".join(lines)


def chat(tokenizer, tokens: int, seed: int) -> list[dict]:
    return [{"role": "user", "content": "Please read this document:\n" + document(tokenizer, tokens, seed)},
            {"role": "assistant", "content": "I have read it. What would you like to know?"}]


def ask(engine: Engine, messages: list[dict], question: str, new_tokens: int = REPLY):
    messages = messages + [{"role": "user", "content": question}]
    done = engine.submit(Request(messages=messages, sampling=SamplingParams(
        max_new_tokens=new_tokens, temperature=0, ignore_eos=True))).result()
    return messages + [{"role": "assistant", "content": done.text, "token_ids": done.token_ids}], done


class Timed:
    """Wall time and bytes of each tier restore (the engine's own ``KVTiers.restore``)."""

    def __init__(self, engine: Engine):
        self.seconds, self.tokens = 0.0, 0
        tiers, real = engine.kvpool.tiers, engine.kvpool.tiers.restore

        def restore(seq):
            t0 = time.perf_counter()
            ram, disk = real(seq)
            self.seconds += time.perf_counter() - t0
            self.tokens += ram + disk
            return ram, disk

        tiers.restore = restore
        self.bytes_per_token = engine.kvpool.bytes_per_token()

    def rate(self) -> float:
        return self.tokens * self.bytes_per_token / self.seconds if self.seconds else 0.0


def new_engine(lm, precision: str, disk: DiskTier | None, ram: int | None = None) -> Engine:
    config = EngineConfig(max_context=CONTEXT, kv_precision=precision, ram_cache_bytes=ram,
                          disk_cache_bytes=0 if disk is None else 4 << 30)
    engine = Engine(config, loaded=lm, disk_tier=disk)
    engine.wait_ready()
    at_full_speed(engine)
    engine.generate([{"role": "user", "content": "warm-up"}], max_new_tokens=2, temperature=0)
    return engine


def phase(done, timed: Timed | None = None) -> dict:
    s = done.stats
    out = {"ttft_ms": s.ttft_ms, "prompt_tokens": s.prompt_tokens, "computed_tokens": s.computed_tokens,
           "pool_tokens": s.pool_tokens, "ram_tokens": s.ram_tokens, "disk_tokens": s.disk_tokens}
    if timed is not None:
        out["restore_s"], out["restore_bytes_per_s"] = timed.seconds, timed.rate()
    return out


def bench_resume(model: str = "starter", precision: str = "fp16", tokens: int = 6000, others: int = 4) -> dict:
    lm = load(model)
    tok = lm.tokenizer
    folder = Path(tempfile.mkdtemp(prefix="kvchat-resume-")) / "kv-blocks"
    result = {"machine": machine(), "model": model, "kv_precision": precision, "context": CONTEXT}
    engine = new_engine(lm, precision, DiskTier(folder))
    convo, cold = ask(engine, chat(tok, tokens, 0), "What does the first rule say?")
    result["cold"] = phase(cold)
    for seed in range(1, others + 1):  # four other long chats: the conversation leaves the pool
        ask(engine, chat(tok, tokens, seed), "Summarise it in one line.", new_tokens=4)
    timed = Timed(engine)
    convo, evicted = ask(engine, convo, "And the second rule?")
    result["evicted"] = phase(evicted, timed)
    engine.close()
    restarted = new_engine(lm, precision, DiskTier(folder))
    timed = Timed(restarted)
    _, again = ask(restarted, convo, "And the third rule?")
    result["restarted"] = phase(again, timed)
    restarted.close()
    result["disk_read_bytes_per_s"] = read_rate(folder)
    for name in ("evicted", "restarted"):
        r = result[name]
        r["ttft_ratio"] = r["ttft_ms"] / result["cold"]["ttft_ms"]
        r["from_tiers"] = (r["ram_tokens"] + r["disk_tokens"]) / r["prompt_tokens"]
    result["in_pool"] = in_pool_cost(lm, precision, tok)
    return result


def read_rate(folder: Path) -> float:
    """Plain reads of every block file (from the page cache where the files are still there)."""
    files = sorted(folder.glob("*.kvb"))
    t0 = time.perf_counter()
    size = sum(len(p.read_bytes()) for p in files)
    return size / (time.perf_counter() - t0)


def in_pool_cost(lm, precision: str, tok, repeats: int = 3) -> dict:
    """A 2,000-token chat that stays in the pool, then 128 tokens of reply, tiers on and off in
    turn; medians. The disk write of each turn's new blocks happens after the reply's last token."""
    out = {}
    runs = [("warm-up", None, 0)] + [("off", None, 0), ("on", "fresh", None)] * repeats
    for name, disk, ram in runs:
        folder = Path(tempfile.mkdtemp(prefix="kvchat-resume-")) / "kv-blocks"
        engine = new_engine(lm, precision, DiskTier(folder) if disk else None, ram)
        messages = chat(tok, 2000, 100 + len(out.get(name, {}).get("prefill_tok_s", [])))
        t0 = time.perf_counter()
        _, done = ask(engine, messages, "What is it about?", new_tokens=128)
        total = time.perf_counter() - t0
        engine.close()
        r = out.setdefault(name, {"prefill_tok_s": [], "decode_tok_s": [], "after_reply_ms": []})
        r["prefill_tok_s"].append(done.stats.computed_tokens / done.stats.ttft_ms * 1000)
        r["decode_tok_s"].append(done.stats.decode_tok_s)
        decode_s = (done.stats.generated_tokens - 1) / done.stats.decode_tok_s
        r["after_reply_ms"].append((total - done.stats.ttft_ms / 1000 - decode_s) * 1000)
    del out["warm-up"]  # the first engine's run: the process's first big prefill, not the tiers'
    for r in out.values():
        for key in list(r):
            r[key] = statistics.median(r[key])
    out["prefill_ratio"] = out["on"]["prefill_tok_s"] / out["off"]["prefill_tok_s"]
    out["decode_ratio"] = out["on"]["decode_tok_s"] / out["off"]["decode_tok_s"]
    return out


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"machine: {r['machine']}; {r['model']}, KV {r['kv_precision']}, context {r['context']:,}")
    print(f"{'':<34}{'TTFT ms':>9}{'x cold':>8}{'prompt':>8}{'computed':>9}{'pool':>7}{'RAM':>7}{'disk':>7}"
          f"{'restore MB/s':>14}")
    for name, label in (("cold", "cold"), ("evicted", "after 4 other long chats"), ("restarted", "after a restart")):
        p = r[name]
        ratio = f"{p['ttft_ratio']:.3f}" if "ttft_ratio" in p else "1"
        rate = f"{p['restore_bytes_per_s'] / 1e6:,.0f}" if p.get("restore_bytes_per_s") else "-"
        print(f"{label:<34}{p['ttft_ms']:>9.0f}{ratio:>8}{p['prompt_tokens']:>8}{p['computed_tokens']:>9}"
              f"{p['pool_tokens']:>7}{p['ram_tokens']:>7}{p['disk_tokens']:>7}{rate:>14}")
    for name in ("evicted", "restarted"):
        p = r[name]
        print(f"{name}: TTFT {p['ttft_ratio']:.3f}x cold (target <= 0.2), {100 * p['from_tiers']:.1f} % of the "
              "prompt from the tiers (target >= 95 %)")
    print(f"plain reads of the block files: {r['disk_read_bytes_per_s'] / 1e6:,.0f} MB/s")
    c = r["in_pool"]
    for name in ("off", "on"):
        s = c[name]
        print(f"tiers {name:<3}: prefill {s['prefill_tok_s']:.0f} tok/s, decode {s['decode_tok_s']:.1f} tok/s, "
              f"after the reply {s['after_reply_ms']:.0f} ms")
    print(f"tiers on / off: prefill {c['prefill_ratio']:.3f}, decode {c['decode_ratio']:.3f} (target >= 0.97)")
