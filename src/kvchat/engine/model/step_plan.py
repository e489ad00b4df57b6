"""What one engine step computes, as plain data between its three parts (nano-vllm's
``LLMEngine.step``, vLLM v1's ``SchedulerOutput``): the scheduler decides it (``StepPlan``), the
model runner executes it (``StepOutput``), and the scheduler's jobs sample and stream from that.
Every block the plan's sequences write was reserved before the plan was made."""
from dataclasses import dataclass

import torch

from kvchat.engine.kv.manager import Sequence


@dataclass(frozen=True)
class Chunk:
    """Compute ``seq``'s tokens ``seq.num_computed .. end``; the last one's logits when wanted (the
    prompt's last chunk, whose first token is sampled)."""
    seq: Sequence
    end: int
    want_logits: bool | str | int  # "all": every row's (evaluation); n: the last n rows' (a check)


@dataclass(frozen=True)
class StepPlan:
    chunk: Chunk | None = None  # at most one prefill chunk, before the batch's token
    # every token of each not yet computed, in one batched forward: its own last token, and after
    # it the tokens proposed to follow (a speculative check), each a row of its own
    decode: tuple[Sequence, ...] = ()

    @property
    def empty(self) -> bool:
        return self.chunk is None and not self.decode


@dataclass
class StepOutput:
    """Each part's logits, or the exception it raised: a failed chunk must not stop the batch."""
    chunk_logits: torch.Tensor | None = None
    chunk_error: Exception | None = None
    decode_logits: torch.Tensor | None = None  # [rows, vocab], each sequence's rows in turn
    decode_seconds: float = 0.0  # what the batch's forward took (speculation.CheckGate)
    decode_error: Exception | None = None
