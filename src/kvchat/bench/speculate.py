"""``kvchat bench speculate``: replies with speculation off and on, side by side in one run.

Each task is a greedy reply (the engine a user gets: Auto KV, the compiled step, weights Auto),
timed off then on, ``repeats`` times in turn so that a drift of the machine reaches both alike:
- edit: a 60-line Python function pasted with "rename ``x`` to ``count`` and add type hints";
- rewrite: an informal paragraph to rewrite formally;
- open: a question whose answer is in no earlier text;
- clients: the edit task from ``clients`` clients at once (each its own name for ``x``);
- prediction: the edit task again with the reply's own text as an OpenAI prediction.
Decode tok/s is a reply's tokens after the first over the time from its first token to its last
(what a user watches stream); clients: every client's tokens over the wall time."""
import json
import statistics
import time
from pathlib import Path

from kvchat.bench.engine import at_full_speed, cpu_build, describe_cpu_build, machine
from kvchat.core.config import MAX_RUNNING, EngineConfig, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.engine import Engine

TEXTS = Path(__file__).parent / "texts"
NAMES = ("count", "total", "seen", "tally", "kept", "valid", "number", "done")


def tasks(code: str, paragraph: str) -> dict[str, list[dict]]:
    return {
        "edit": edit(code, NAMES[0]),
        "rewrite": [{"role": "user", "content": f"Rewrite this paragraph more formally:\n\n{paragraph}"}],
        "open": [{"role": "user", "content": "What are three good habits for learning a new language?"}],
    }


def edit(code: str, name: str) -> list[dict]:
    return [{"role": "user", "content": f"Rename `x` to `{name}` and add type hints:\n\n```python\n{code}```"}]


def _reply(engine, messages, max_tokens: int, prediction: str | None = None):
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    return engine.submit(Request(messages=messages, sampling=params, prediction=prediction)).result()


def _clients(engine, code: str, clients: int, max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_new_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    handles = [engine.submit(Request(messages=edit(code, NAMES[i % len(NAMES)]), sampling=params))
               for i in range(clients)]
    done = [h.result() for h in handles]
    return sum(d.stats.generated_tokens for d in done) / (time.perf_counter() - start), done


def _engine(lm, model: str, speculate: bool, clients: int, kv_precision: str) -> Engine:
    """The first engine loads the model on its own thread, the next ones take it over: a model
    loaded on this thread left an OpenMP team here, and libgomp, managing more threads than
    cores, stops spinning between parallel regions: the engine thread's decode ran at half speed
    (starter, 2 cores: 43 tok/s against 101)."""
    engine = Engine(EngineConfig(model=model, weights="auto", max_running=clients, speculate=speculate,
                                 kv_precision=kv_precision), loaded=lm, disk_tier=None)
    engine.wait_ready()
    at_full_speed(engine, batch=MAX_RUNNING)  # a check of 15 proposals is a batch of 16 rows
    _reply(engine, [{"role": "user", "content": "warm-up"}], 4)
    return engine


def bench_speculate(model: str = "starter", max_tokens: int = 256, clients: int = 8, repeats: int = 2,
                    kv_precision: str = "fp16") -> dict:
    lm = None
    code = (TEXTS / "speculate_function.py.txt").read_text()
    work = tasks(code, (TEXTS / "speculate_paragraph.txt").read_text())
    runs = {name: {"off": [], "on": []} for name in (*work, "clients")}
    replies: dict = {}
    accepted: dict = {}
    for _ in range(repeats):
        for mode in ("off", "on"):
            engine = _engine(lm, model, mode == "on", clients, kv_precision)
            lm = engine.loaded
            try:
                for name, messages in work.items():
                    done = _reply(engine, messages, max_tokens)
                    runs[name][mode].append(done.stats.decode_tok_s)
                    replies[name, mode] = done.token_ids
                    accepted[name, mode] = (done.stats.accepted_prediction_tokens,
                                            done.stats.rejected_prediction_tokens)
                tok_s, done = _clients(engine, code, clients, max_tokens)
                runs["clients"][mode].append(tok_s)
                replies["clients", mode] = [d.token_ids for d in done]
                accepted["clients", mode] = (sum(d.stats.accepted_prediction_tokens for d in done),
                                             sum(d.stats.rejected_prediction_tokens for d in done))
                if mode == "on":
                    expected = engine.loaded.tokenizer.decode(replies["edit", "off"], skip_special_tokens=True)
                    predicted = _reply(engine, work["edit"], max_tokens, prediction=expected)
            finally:
                engine.close()
    rows = {}
    for name, modes in runs.items():
        off, on = statistics.median(modes["off"]), statistics.median(modes["on"])
        kept, dropped = accepted[name, "on"]
        rows[name] = {"off_tok_s": round(off, 1), "on_tok_s": round(on, 1), "ratio": round(on / off, 2),
                      "accepted": kept, "rejected": dropped,
                      "acceptance": round(kept / (kept + dropped), 3) if kept + dropped else None,
                      "identical": replies[name, "off"] == replies[name, "on"]}
    predicted_tokens = len(lm.tokenizer.encode(expected, add_special_tokens=False))  # Rust: no OpenMP team
    return {"machine": machine(), "cpu_build": cpu_build(lm.model), "kv_precision": kv_precision,
            "max_tokens": max_tokens, "clients": clients,
            "repeats": repeats, "tasks": rows,
            "prediction": {"predicted_tokens": predicted_tokens,
                           "accepted": predicted.stats.accepted_prediction_tokens,
                           "rejected": predicted.stats.rejected_prediction_tokens,
                           "accepted_of_predicted": round(predicted.stats.accepted_prediction_tokens
                                                          / max(1, predicted_tokens), 3),
                           "identical": predicted.token_ids == replies["edit", "off"],
                           "tok_s": round(predicted.stats.decode_tok_s, 1)}}


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"{r['machine']}; {describe_cpu_build(r['cpu_build'])}")
    print(f"greedy replies of up to {r['max_tokens']} tokens, KV {r['kv_precision']}, median of {r['repeats']} "
          "runs each way, off and on in turn")
    print(f"{'task':<10} {'off tok/s':>10} {'on tok/s':>10} {'ratio':>7} {'accepted':>9} {'rate':>6}  identical")
    for name, row in r["tasks"].items():
        rate = f"{row['acceptance']:.0%}" if row["acceptance"] is not None else "-"
        label = f"{r['clients']} clients" if name == "clients" else name
        print(f"{label:<10} {row['off_tok_s']:>10.1f} {row['on_tok_s']:>10.1f} {row['ratio']:>6.2f}x "
              f"{row['accepted']:>9} {rate:>6}  {'yes' if row['identical'] else 'NO'}")
    p = r["prediction"]
    print(f"edit with its reply as the prediction: {p['accepted']} of {p['predicted_tokens']} predicted tokens "
          f"accepted ({p['accepted_of_predicted']:.0%}), {p['rejected']} rejected, {p['tok_s']:.1f} tok/s, "
          f"identical: {'yes' if p['identical'] else 'NO'}")
