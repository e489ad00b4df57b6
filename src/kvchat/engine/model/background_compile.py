"""Compiling on a thread of its own, so that no reply waits for a compile.

The decode step decodes eagerly until the graph its pool needs is ready, then moves to it between
two tokens. A new user's first reply waited 90 s (quiet machine) to 350 s (busy) for the compile
before; now it starts at eager speed at once. The jobs are named (``"weights"``, a graph's kind):
each runs once, in the order asked; a failure ends the queue (``failed``), and the step then stays
eager and says why.
"""
import os
import sys
import threading
from collections import deque
from time import perf_counter

import torch

from kvchat.kernels import traced

from kvchat.engine.compile_env import confine_fx_patches

from kvchat.engine.model.attention import BatchMeta, StepMeta, running

SWITCH_S = float(os.environ.get("KVCHAT_SWITCH_S", "0.0002"))
STAND_IN_BLOCKS = 4  # the pool a background compile traces on: its size is a dynamic dimension


class BackgroundCompile:
    def __init__(self, on_failure):
        confine_fx_patches()  # a trace on the compile thread must not reach the engine thread's modules
        self.on_failure = on_failure  # called with the exception, on the compile thread
        self.ready: set[str] = set()
        self.failed: Exception | None = None
        self._lock = threading.RLock()
        self._pending: list[tuple[str, object]] = []
        self._thread: threading.Thread | None = None
        self._finished: deque[tuple[str, float]] = deque()  # (job, seconds), not yet told

    def known(self, name: str) -> bool:
        """Ran, queued, or never to run (an earlier job failed)."""
        with self._lock:
            return self.failed is not None or name in self.ready or any(n == name for n, _ in self._pending)

    def want(self, name: str, job) -> bool:
        """Queue ``job()`` under ``name`` unless it is known; True when it was queued now."""
        with self._lock:
            if self.known(name):
                return False
            self._pending.append((name, job))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="kvchat-compile", daemon=True)
                self._thread.start()
            return True

    def busy(self) -> bool:
        with self._lock:
            return self._thread is not None

    def take_finished(self) -> list[tuple[str, float]]:
        """The jobs that ended since the last call, with their seconds: for the engine to tell."""
        out = []
        while self._finished:
            out.append(self._finished.popleft())
        return out

    def wait(self, timeout: float | None = None) -> bool:
        """Until the queue is empty (benchmarks and tests); True when it is."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return not self.busy()

    def _work(self) -> None:
        """The jobs in turn. While they run, Python switches threads every ``SWITCH_S``: an eager
        step releases the GIL in every op, and at the default 5 ms each op waited up to that long
        for this thread to let go (the starter decoded 1.4 tok/s eagerly during a compile)."""
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, SWITCH_S))
        try:
            self._run_jobs()
        finally:
            sys.setswitchinterval(interval)

    def _run_jobs(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._thread = None
                    return
                name, job = self._pending[0]
            started = perf_counter()
            try:
                job()
            except Exception as error:  # no compiler, an op inductor cannot lower: eager still works
                with self._lock:
                    self.failed = error
                    self._pending.clear()
                    self._thread = None
                self.on_failure(error)
                return
            with self._lock:
                self._pending.pop(0)
                self.ready.add(name)
            self._finished.append((name, perf_counter() - started))


def graph_kind(kv) -> str:
    """Which compiled graph decodes on ``kv``: fp16 pools trace their attention, quantized ones and
    those whose windowed layers are in rings (read through the cache's block map) call the op."""
    return "traced" if traced.supports(kv.format) and not kv.local else "op"


def run_on_stand_ins(forward, kind: str, layers: list[dict], device, batch: int = 1) -> None:
    """Compile the decode step's graph of ``kind`` by running ``forward`` once on inputs of its
    own: a stand-in pool of ``STAND_IN_BLOCKS`` blocks shaped like ``layers`` (``{name: (shape
    after the block dim, dtype)}`` per layer), its size marked dynamic so the graph serves every
    pool; or, for the op, a pool that is never read. ``batch`` rows: a batched step's graph, its
    block table ``[batch, blocks]``. The model's weights are only read. Plain tensors run in
    inference mode, as the engine runs its step: an inference tensor where the step has a plain
    one fails a guard (its dispatch keys), and the engine thread compiled again."""
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
    slot = torch.full((batch,), -1, dtype=torch.long, device=device)
    length = torch.ones(batch, dtype=torch.int32, device=device)
    if kind == "traced":
        pool = [{name: torch.zeros(STAND_IN_BLOCKS, *shape, dtype=dtype, device=device)
                 for name, (shape, dtype) in layer.items()} for layer in layers]
        for t in (t for layer in pool for t in layer.values()):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        table = torch.zeros(*([batch] if batch > 1 else []), 2, dtype=torch.long, device=device)
        torch._dynamo.maybe_mark_dynamic(table, table.dim() - 1)
        with torch.inference_mode():
            forward(ids, positions, {"layers": pool, "slot": slot, "table": table, "length": length})
        return
    meta = unread_meta(device)
    with running(BatchMeta([meta] * batch) if batch > 1 else meta), torch.inference_mode():
        forward(ids, positions)


def unread_meta(device) -> StepMeta:
    """A step over a pool that takes no K/V and gives zeros: a stand-in, or a batch's padding row."""
    return StepMeta(kv=_UnreadPool(), slots=torch.full((1,), -1, dtype=torch.long, device=device),
                    block_table=torch.zeros(1, dtype=torch.int32, device=device), context_len=1,
                    context_lens=torch.ones(1, dtype=torch.int32, device=device))


class _UnreadPool:
    """The pool of the op's stand-in run: it takes no K/V and gives zeros."""

    def write(self, *args):
        return None

    def attend(self, layer, query, *args):
        return torch.zeros_like(query)
