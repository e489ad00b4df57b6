"""Compiling in a child process, so that a reply's eager tokens keep their speed.

A compile on a thread of this process shares the GIL with the eager step, which gives the GIL back
in each of its ~1,200 ops a token and then waits to get it again: the starter decoded 2 tok/s
(21 alone) for the 2-3 minutes of a first compile, and 2-3 tok/s for the 30 s of a compile from a
warm cache. A child process at low priority compiles the same graph into inductor's disk cache
while the eager step here keeps 17-24 tok/s; this process then compiles from that cache in an idle
moment (``ModelHost.prepare_decode``), never between two tokens. On two cores the child gets the
CPU mostly between replies, and takes longer than a compile here; nobody waits for it.

The child is kvchat itself: ``sys.executable -c`` runs Python's code in a venv and in the packaged
app alike (``packaging/kvchat_entry.py``). It loads the model as the engine did, with its own copy
of the weights, so it is started only where the RAM holds a second copy.
"""
import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch

from kvchat.core.paths import cache_dir

log = logging.getLogger("kvchat.decode")

HERE = "KVCHAT_COMPILE_HERE"  # set in a child (and in ``kvchat prepare``): compile in this process
SPARE_BYTES = 2 << 30  # a compiling child's own RAM beyond its weights (torch, inductor, the pool)
CHILD_CODE = "import sys; from kvchat.engine.precompile import compile_graphs; sys.exit(compile_graphs(sys.argv[1]))"
TIMES = "compile_seconds.json"  # in the cache dir: how long each model's compile took here, the last time


def compiles_here() -> bool:
    return os.environ.get(HERE) == "1"


class CacheWarmer:
    """The children that compile a model's graphs (by kind: ``background_compile.graph_kind``)."""

    def __init__(self, spec: dict):
        self.spec = spec  # the model as the engine loaded it: model, device, dtype, weights, decode
        self._children: dict[str, subprocess.Popen] = {}
        self._started: dict[str, float] = {}
        self._stopped: set[str] = set()  # kinds whose child ``close`` ended on purpose

    @classmethod
    def for_model(cls, config, device: str, free_bytes: int, weights_bytes: int) -> "CacheWarmer | None":
        """A warmer for a model the engine loaded from ``config`` on ``device``, or None where the
        compile stays in this process: a child itself, a CUDA device (it captures graphs instead),
        eager decoding, or too little free RAM for a second copy of the weights."""
        if compiles_here() or device != "cpu" or config.decode == "eager":
            return None
        if free_bytes < weights_bytes + SPARE_BYTES:
            log.info("compiling in this process: %d MiB free, a child needs %d", free_bytes >> 20,
                     (weights_bytes + SPARE_BYTES) >> 20)
            return None
        return cls({"model": config.model, "device": "cpu", "dtype": config.dtype, "weights": config.weights,
                    "decode": config.decode})

    def start(self, kind: str) -> bool:
        """Start the child for ``kind`` unless one was started, or another is running (each
        holds a copy of the weights); True when it was started now."""
        if kind in self._children or any(child.poll() is None for child in self._children.values()):
            return False
        env = dict(os.environ, **{HERE: "1"})
        spec = {**self.spec, "kind": kind, "threads": torch.get_num_threads()}
        command = [sys.executable, "-c", CHILD_CODE, json.dumps(spec)]
        self._started[kind] = time.monotonic()
        self._children[kind] = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL,
                                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        threading.Thread(target=self._watch, args=(kind,), name="kvchat-compile-child", daemon=True).start()
        return True

    def _watch(self, kind: str) -> None:
        """Log how the child ended: a failure is not the user's to read here, as the compile in
        this process that follows fails the same way and says why."""
        child = self._children[kind]
        _, err = child.communicate()
        seconds = time.monotonic() - self._started[kind]
        if kind in self._stopped:
            log.info("the %s graph's compile child was stopped after %.0f s (a model change or the "
                     "engine's end); what it compiled stays cached", kind, seconds)
        elif child.returncode:
            last = err.decode(errors="replace").strip().splitlines()[-1:] or [""]
            log.warning("the %s graph's compile child ended with %s after %.0f s: %s", kind, child.returncode,
                        seconds, last[0])
        else:
            log.info("the %s graph compiled in a child in %.0f s", kind, seconds)
            self._remember(kind, seconds)

    def _key(self, kind: str) -> str:
        """The compile as this machine runs it: the model, its weights and the CPU's instruction set."""
        return json.dumps([self.spec, kind, torch.backends.cpu.get_cpu_capability()], sort_keys=True)

    def expected(self, kind: str) -> float | None:
        """Seconds the last compile of ``kind`` took here, where one ended; what a progress line
        counts against (None: the first time)."""
        try:
            return json.loads((cache_dir() / TIMES).read_text()).get(self._key(kind))
        except (OSError, ValueError, AttributeError):
            return None

    def _remember(self, kind: str, seconds: float) -> None:
        path = cache_dir() / TIMES
        try:
            times = json.loads(path.read_text()) if path.exists() else {}
            times[self._key(kind)] = round(seconds, 1)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(times))
            tmp.replace(path)
        except (OSError, ValueError, TypeError) as e:  # a figure for a progress line: never worth failing for
            log.info("could not keep the compile's time: %s", e)

    def running(self, kind: str) -> bool:
        child = self._children.get(kind)
        return child is not None and child.poll() is None

    def done(self, kind: str) -> bool:
        """The child for ``kind`` has ended, compiled or not."""
        child = self._children.get(kind)
        return child is not None and child.poll() is not None

    def seconds(self, kind: str) -> float:
        """Since the child for ``kind`` started (0 where none did)."""
        return time.monotonic() - self._started[kind] if kind in self._started else 0.0

    def close(self) -> None:
        """Stop the children still compiling (a model change, the engine's end): what they
        compiled so far stays in the cache."""
        for kind, child in self._children.items():
            if child.poll() is None:
                self._stopped.add(kind)
                child.kill()
                child.wait()

