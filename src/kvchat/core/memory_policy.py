"""What Auto decides about memory, in one place and on one ladder.

A KV pool under Auto starts at the best precision whose pool holds at least a block beside the
windowed layers' rings, and steps down the same ladder (``LADDER``: fp16, int8, k8v4, int4) from
both of the places where it must:
- memory pressure (another program took memory): to the best rung whose pool, in the bytes left,
  still holds the context asked for, else the rung that holds the most, as long as it keeps the
  tokens in use;
- a full pool (every block held by running requests): one rung down in the same bytes; at the
  bottom, or where a lower precision adds no token (every layer in rings, or the rings are what is
  full), a running request is preempted instead.
A precision asked for by name never moves. The weights the settings' memory estimate assumes
under Auto are decided here as well. No torch: the app asks it too.
"""
from dataclasses import dataclass
from typing import Callable

from kvchat.core.config import LADDER, Precision

DTYPE_FORMATS = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}  # a model left in its dtype


@dataclass(frozen=True)
class StepDown:
    """Rebuild the pool at ``precision`` in its own bytes."""
    precision: Precision


@dataclass(frozen=True)
class Preempt:
    """Free a running request's blocks (or make the asking one wait): no precision helps."""


class MemoryPolicy:
    def __init__(self, requested, quantizable: bool = True):
        self.requested = Precision(requested)
        self.auto = self.requested == Precision.AUTO
        self.quantizable = quantizable  # kv_sizes.quantizable: a head_dim the quantized formats take

    def rungs(self, current: Precision | None = None) -> tuple[Precision, ...]:
        """The precisions a pool at ``current`` (None: a new pool) may take, best first."""
        if not self.auto:
            return (self.requested,)
        if not self.quantizable:
            return (Precision.FP16,)
        return LADDER[LADDER.index(current):] if current in LADDER else LADDER

    def lowest(self) -> Precision:
        """What the pool may step down to at most: what bounds the context a prompt may use."""
        return self.rungs()[-1]

    def start(self, holds: Callable[[Precision], bool]) -> Precision:
        """The new pool's precision: the first rung whose pool ``holds`` a block, else the lowest
        (whose caller says why nothing fits)."""
        return next((p for p in self.rungs() if holds(p)), self.lowest())

    def under_pressure(self, current: Precision, tokens_for: Callable[[Precision], int], in_use: int,
                       context: int) -> Precision | None:
        """The precision a pool shrunk to the bytes left takes (``tokens_for(p)``: what it holds
        then): the best that holds the ``context`` asked for, else the one that holds the most,
        among those that keep the ``in_use`` tokens; None where none does."""
        fits = [p for p in self.rungs(current) if tokens_for(p) >= in_use]
        whole = [p for p in fits if tokens_for(p) >= context]
        return whole[0] if whole else (fits[-1] if fits else None)

    def when_full(self, current: Precision, rings_full: bool, whole_layers: bool) -> StepDown | Preempt:
        """A full pool: the next rung down, in the same bytes; a preemption at the bottom, where
        the rings are what is full, or where no layer keeps the whole context (its blocks hold
        no bytes: a lower precision adds no token)."""
        rungs = self.rungs(current)
        if len(rungs) < 2 or rings_full or not whole_layers:
            return Preempt()
        return StepDown(rungs[1])


def estimate_weights(setting: str, on_cuda: bool, chosen: str | None = None) -> str:
    """The weights format (``memory.WEIGHT_BYTES``) the settings' memory estimate assumes for a
    weights ``setting``: under auto, what the engine chose for the loaded model (``chosen``: on the
    CPU a measurement picks it), else what auto takes before it measures: the checkpoint's own
    16-bit weights on CUDA, int8 on the CPU."""
    full = "bf16" if on_cuda else "fp32"
    if setting == "auto":
        if chosen:
            return DTYPE_FORMATS.get(chosen, chosen)
        return full if on_cuda else "int8"
    return {"none": full, "int4": "int4" if not on_cuda else "nf4"}.get(setting, setting)

