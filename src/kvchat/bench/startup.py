"""``kvchat bench startup``: how long a new user waits, from fresh dirs and from warm ones, side by side.

Each run is a new process in one KVCHAT_HOME (empty for the fresh run, left as the fresh run left it
for the warm one), with the app's default settings (Auto KV, 8,192 tokens, Auto weights). It sends a
message the moment the engine is made, as a user who types while the model loads, and keeps
replying, with a reader's pause between replies, until the decode step runs at full speed; then
changes the context, the KV precision and the weights in turn and sends a message after each. The
window is timed apart (the app offscreen, its own first-frame trace), since it shows before the
engine is made.

Every time is in seconds from what the user did: the launch, or the change.
"""
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace

ROWS = (
    ("window", "window shown"),
    ("ready", "model ready"),
    ("first_token", "first token, message sent at once"),
    ("full_speed", "first token at full speed"),
    ("context_first", "context change: next reply's first token"),
    ("context_full", "context change: first token at full speed"),
    ("precision_first", "KV precision change: next reply's first token"),
    ("precision_full", "KV precision change: first token at full speed"),
    ("weights_ready", "weights change: model ready"),
    ("weights_first", "weights change: first token"),
    ("weights_full", "weights change: first token at full speed"),
)
MESSAGE = [{"role": "user", "content": "Name three colors."}]
TOKENS = 16  # per reply: replies follow each other until the step runs compiled
PATIENCE_S = 900  # how long a run waits for full speed before it gives up on that row
# a reader's pause between replies: the compile child (niced) gets the CPU mostly then, and the
# app loads its result only in an idle moment; back-to-back replies left it 10 % of a core
READ_S = 10.0


def bench_startup(model: str = "starter", home: str | None = None) -> dict:
    home = home or tempfile.mkdtemp(prefix="kvchat-startup-")
    out = {"model": model, "home": home}
    for run in ("fresh", "warm"):
        window_home = tempfile.mkdtemp(prefix="kvchat-window-") if run == "fresh" else home
        out[run] = {"window": window_seconds(window_home), **child_run(model, home)}
    return out


def window_seconds(home: str, timeout: float = 60) -> float | None:
    """Launch to the app's first frame (offscreen), from its own trace; the app is closed at once."""
    env = {**os.environ, "KVCHAT_HOME": home, "KVCHAT_STARTUP_TRACE": "1",
           "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen")}
    code = "import sys; from kvchat.cli.launcher import main; sys.argv = ['kvchat']; sys.exit(main())"
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout
        for line in proc.stderr:
            if "first frame" in line:
                return float(line.split("first frame", 1)[1].split()[0])
            if time.monotonic() > deadline:
                break
        return None
    finally:
        proc.kill()
        proc.wait()


def child_run(model: str, home: str) -> dict:
    """One start in a process of its own: its imports and loads are what a user's start pays."""
    env = {**os.environ, "KVCHAT_HOME": home}
    spawned = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "kvchat.bench.startup", model], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the startup run failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("ready", "first_token", "full_speed"):  # monotonic clock: the same in both processes
        if result.get(key) is not None:
            result[key] = round(result[key] - spawned, 2)
    return result


class Watch:
    """The engine's events, timestamped as they arrive on the engine thread."""

    def __init__(self, engine):
        self.lock = threading.Lock()
        self.ready_at = self.full_at = None
        self.preparing = False
        engine.add_listener(self.on_event)

    def on_event(self, event) -> None:
        from kvchat.core.events import ModelReady, Notice

        with self.lock:
            if isinstance(event, ModelReady):
                self.ready_at = time.monotonic()
            elif isinstance(event, Notice) and event.kind == "warm-up":
                self.preparing = event.message.startswith("preparing")
                if not self.preparing:
                    self.full_at = time.monotonic()
            elif isinstance(event, Notice) and event.kind == "eager":
                self.preparing = False  # no compile: eager is the full speed there is

    def reply(self, engine) -> list[float]:
        """Send the message; when each of its tokens came."""
        from kvchat.core.config import SamplingParams
        from kvchat.core.events import Request, TokenDelta

        times = []
        listener = lambda e: times.append(time.monotonic()) if isinstance(e, TokenDelta) else None
        engine.submit(Request(messages=MESSAGE, sampling=SamplingParams(max_new_tokens=TOKENS, temperature=0)),
                      listener).result()
        return times

    def full_speed(self, engine, since: float, tokens: list[float]) -> float | None:
        """The first token after the compile that began after ``since`` ended, from ``tokens`` or
        the replies sent next; the first token when nothing compiles (or the compile failed:
        eager is the full speed there is)."""
        deadline = time.monotonic() + PATIENCE_S
        while time.monotonic() < deadline:
            with self.lock:
                preparing, full_at = self.preparing, self.full_at
            if not preparing:
                if full_at is None or full_at < since:
                    return tokens[0] if tokens else None
                later = [t for t in tokens if t > full_at]
                if later:
                    return later[0]
            elif tokens:
                time.sleep(READ_S)
            tokens = tokens + self.reply(engine)
        return None


def _child(model: str) -> dict:
    from kvchat.core.config import EngineConfig
    from kvchat.engine.engine import Engine

    config = EngineConfig(model=model, kv_precision="auto", weights="auto")
    started = time.monotonic()
    engine = Engine(config)
    watch = Watch(engine)
    try:
        tokens = watch.reply(engine)  # sent at once: it waits for the model, not for a compile
        out = {"ready": watch.ready_at, "first_token": tokens[0] if tokens else None,
               "full_speed": watch.full_speed(engine, started, tokens)}
        step = engine.kvpool.runner.step
        out["decode_mode"] = step.mode if step.captured else "eager"
        changed = time.monotonic()
        engine.reconfigure(max_context=config.max_context // 2).result()
        out["context_first"], out["context_full"] = _after_change(watch, engine, changed)
        changed = time.monotonic()
        engine.reconfigure(kv_precision="int8").result()
        out["precision_first"], out["precision_full"] = _after_change(watch, engine, changed)
        changed = time.monotonic()
        engine.load_model(replace(engine.config, weights="none")).result()
        out["weights_ready"] = round(time.monotonic() - changed, 2)
        out["weights_first"], out["weights_full"] = _after_change(watch, engine, changed)
        return out
    finally:
        engine.close()


def _after_change(watch: Watch, engine, changed: float) -> tuple[float | None, float | None]:
    """Seconds from the change to the next reply's first token, and to the first at full speed."""
    tokens = watch.reply(engine)
    seconds = lambda t: None if t is None else round(t - changed, 2)
    return seconds(tokens[0] if tokens else None), seconds(watch.full_speed(engine, changed, tokens))


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"kvchat bench startup: {result['model']}, decode {result['fresh'].get('decode_mode', '?')}, "
          f"home {result['home']}")
    print(f"{'':48} {'fresh':>9} {'warm':>9}")
    show = lambda v: f"{v:8.2f}s" if isinstance(v, (int, float)) else f"{'-':>9}"
    for key, label in ROWS:
        print(f"{label:48} {show(result['fresh'].get(key))} {show(result['warm'].get(key))}")


if __name__ == "__main__":  # a child run: one JSON line on stdout
    print(json.dumps(_child(sys.argv[1] if len(sys.argv) > 1 else "starter")))
