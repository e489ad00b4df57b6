"""``kvchat prepare``: compile now, into this user's cache, what a first start compiles in the
background: the int8 weights' fused paths, and the decode step's graph for the fp16 pool and the
one shared by the quantized pools. `make run`'s set-up and the packaged app's install.sh run it
once, so that a first start is what `bench startup` calls warm: full speed in seconds, not minutes.

It compiles for this machine (its vector units, its compiler), which is why a package cannot
carry the result. Nothing waits for it: a start before it ended compiles in the background as
usual, and both find the other's files in inductor's cache."""
import sys
import threading
import time

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Notice, Request

WAIT_S = 1800  # a cold compile took 2-3 min on 2 busy cores; a machine several times slower still ends


class _Compiles:
    """Whether a compile the engine announced is still running, from its notices."""

    def __init__(self):
        self.running = False
        self.changed = threading.Condition()
        self.outcomes: list[str] = []

    def on_event(self, event) -> None:
        if not isinstance(event, Notice) or event.kind not in ("warm-up", "eager"):
            return
        with self.changed:
            self.running = event.kind == "warm-up" and event.message.startswith("preparing")
            if not self.running:
                self.outcomes.append(event.message)
            self.changed.notify_all()

    def wait(self, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: not self.running, timeout)


def prepare(model: str = "starter", out=sys.stdout) -> dict:
    """Each graph is compiled by what starts it for a user (the first token of a reply), with the
    app's defaults; seconds per stage."""
    from kvchat.engine.engine import Engine

    started = time.monotonic()
    engine = Engine(EngineConfig(model=model, kv_precision="auto", weights="auto"))
    compiles = _Compiles()
    engine.add_listener(compiles.on_event)
    seconds = {}
    try:
        engine.wait_ready(600)
        seconds["load"] = round(time.monotonic() - started, 1)
        for precision in ("fp16", "int8"):  # int8: the graph every quantized precision shares
            stage = time.monotonic()
            engine.reconfigure(kv_precision=precision).result(120)
            print(f"kvchat prepare: compiling the decode step for {precision} KV ...", file=out, flush=True)
            engine.submit(Request(messages=[{"role": "user", "content": "Hi"}],
                                  sampling=SamplingParams(max_new_tokens=2, temperature=0))).result(600)
            if not compiles.wait(WAIT_S):
                raise TimeoutError(f"the {precision} graph did not compile within {WAIT_S} s")
            seconds[precision] = round(time.monotonic() - stage, 1)
    finally:
        engine.close()
    return {"seconds": seconds, "notices": compiles.outcomes}
