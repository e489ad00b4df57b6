"""Compiling the decode step's graphs in a process that does nothing else: ``kvchat prepare``,
and the compile child (``compile_child.py``) that keeps a compile off the app's GIL. Each
graph is compiled by what starts it for a user, a reply's first token, and waited for from the
engine's notices."""
import json
import os
import threading
import time

from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.core.events import Notice, Request
from kvchat.engine.compile_child import HERE

WAIT_S = 1800  # a cold compile took 2-3 min on 2 busy cores; a machine several times slower still ends


class Compiles:
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


def compile_for(config: EngineConfig, precisions, out=None) -> dict:
    """Load the model of ``config`` and compile, in this process, the decode step's graph for a
    pool of each of ``precisions`` (int8: the graph every quantized precision shares)."""
    from kvchat.engine.engine import Engine

    os.environ[HERE] = "1"  # this process is the one that compiles: no child of its own
    started = time.monotonic()
    engine = Engine(config)
    compiles = Compiles()
    engine.add_listener(compiles.on_event)
    seconds = {}
    try:
        engine.wait_ready(600)
        seconds["load"] = round(time.monotonic() - started, 1)
        for precision in precisions:
            stage = time.monotonic()
            engine.reconfigure(kv_precision=precision).result(120)
            if out is not None:
                print(f"kvchat prepare: compiling the decode step for {precision} KV ...", file=out, flush=True)
            engine.submit(Request(messages=[{"role": "user", "content": "Hi"}],
                                  sampling=SamplingParams(max_new_tokens=2, temperature=0))).result(600)
            if not compiles.wait(WAIT_S):
                raise TimeoutError(f"the {precision} graph did not compile within {WAIT_S} s")
            seconds[precision] = round(time.monotonic() - stage, 1)
    finally:
        engine.close()
    return {"seconds": seconds, "notices": compiles.outcomes}


def compile_graphs(spec: str) -> int:
    """A compile child's body (``engine/compile_child.py``): the graph of one kind for the
    model in ``spec`` (JSON), into inductor's disk cache, at low priority: the app's eager
    tokens keep the CPU, and the compile goes on in the moments between replies. Exit status 0
    when it compiled."""
    import torch

    exit_with_parent()
    os.nice(10)
    args = json.loads(spec)
    # the app's thread count, not one: inductor writes it into the C++ it generates, and a graph
    # compiled for another count is another entry in the cache, which the app would miss
    torch.set_num_threads(args.pop("threads"))
    precision = "fp16" if args.pop("kind") == "traced" else "int8"
    # a small pool and no KV tiers: the graph serves every pool size, and nothing here is kept
    config = EngineConfig(**args, kv_precision=precision, max_context=256,
                          ram_cache_bytes=0, disk_cache_bytes=0)
    done = compile_for(config, (precision,))
    return 0 if any(n.startswith("fast decoding ready") for n in done["notices"]) else 1


def exit_with_parent() -> None:
    """In a child: end when the app does (its parent gone, the child is re-parented)."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="kvchat-parent-watch", daemon=True).start()
