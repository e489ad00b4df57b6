"""The model's forward steps, with the K/V in our pool: a step's plan (``step_plan``), one
sequence's chunk, a batch's decode token."""
import time

import torch

from kvchat.kernels.reference import consecutive_start

from kvchat.engine.model.attention import ATTN_NAME, StepMeta, running
from kvchat.engine.model.batch_step import batch_step_for
from kvchat.engine.model.decode_step import decode_step_for, lm_logits
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.model.step_plan import StepOutput, StepPlan


class ModelRunner:
    def __init__(self, model, kv: KVCache, manager: KVCacheManager, decode: str = "eager"):
        model.set_attn_implementation(ATTN_NAME)
        self.model, self.kv, self.manager = model, kv, manager
        self.decoder = getattr(model, model.base_model_prefix)
        self.device = next(model.parameters()).device
        self.step = decode_step_for(model, decode)
        self.batch = batch_step_for(self.step)

    def execute(self, plan: StepPlan) -> StepOutput:
        """The plan's chunk, then its batch's token; each part's failure is its own."""
        out = StepOutput()
        if plan.chunk is not None:
            chunk = plan.chunk
            try:
                out.chunk_logits = self.forward(chunk.seq, chunk.end, chunk.want_logits)
            except Exception as error:  # noqa: BLE001 - the scheduler ends that request with it
                out.chunk_error = error
        if plan.decode:
            start = time.perf_counter()
            try:
                out.decode_logits = self.decode(list(plan.decode))
                if self.device.type == "cuda":  # its sampling waits for it anyway
                    torch.cuda.synchronize(self.device)
            except Exception as error:  # noqa: BLE001 - the scheduler tries each sequence alone
                out.decode_error = error
            out.decode_seconds = time.perf_counter() - start
        return out

    def check_rows(self, want: int) -> int:
        """The most rows a decode batch runs at full speed now (``BatchStep.compiled_rows``)."""
        return self.batch.compiled_rows(self.kv, want)

    @torch.inference_mode()
    def forward(self, seq: Sequence, end: int, want_logits: bool | str | int) -> torch.Tensor | None:
        """Compute tokens ``seq.num_computed .. end`` (blocks must be reserved) and return the
        fp32 logits of the last one when asked. Only evaluation asks for ``"all"`` rows of a chunk;
        generation never builds a ``[T, vocab]`` matrix. One token with its logits wanted is a
        decode step, which may run compiled or captured."""
        start = seq.num_computed
        dev = self.device
        block_ids = self._ready(seq, start, end)
        seq.ring_clean = False  # until the step has written every layer (``_computed``)
        if end == start + 1 and want_logits is True:
            logits = self.step(self.kv, seq.window, seq.token_ids[start], start, self.manager.slot(seq, start), block_ids)
            self._computed(seq, start, end)
            return logits
        meta = StepMeta(
            kv=self.kv,
            slots=torch.tensor([self.manager.slot(seq, p) for p in range(start, end)], device=dev),
            block_table=torch.tensor(block_ids, device=dev, dtype=torch.int32),
            context_len=end,
            first_block=consecutive_start(block_ids),
            window=seq.window,
        )
        ids = torch.tensor([seq.token_ids[start:end]], device=dev)
        positions = torch.arange(start, end, device=dev).unsqueeze(0)
        with running(meta):
            hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False).last_hidden_state
        self._computed(seq, start, end)
        if not want_logits:
            return None
        if want_logits == "all":
            return lm_logits(self.model, hidden[0])
        if want_logits is not True:  # the last rows: a prompt's end and the tokens proposed after it
            return lm_logits(self.model, hidden[0, -want_logits:])
        return lm_logits(self.model, hidden[0, -1:])[0]

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Every token not yet computed of each sequence (blocks reserved), one row each: fp32
        logits ``[rows, vocab]``, each sequence's rows in turn. One row runs the single step,
        which may be captured; more run as one batch (``batch_step``), where a row of a sequence
        reads the K/V its rows before it wrote in the same layer: a speculative check is exact."""
        if len(seqs) == 1 and len(seqs[0]) == seqs[0].num_computed + 1:
            return self.forward(seqs[0], len(seqs[0]), want_logits=True)[None]
        rows = []
        for seq in seqs:
            start = seq.num_computed
            if len(seq) <= start:
                raise ValueError("a decode step computes at least one token")
            block_ids = self._ready(seq, start, len(seq))
            seq.ring_clean = False
            rows += [(seq.window, seq.token_ids[p], p, self.manager.slot(seq, p),
                      block_ids[:self.manager.blocks_needed(p + 1)]) for p in range(start, len(seq))]
        logits = self.batch(self.kv, rows)
        for seq in seqs:
            self._computed(seq, seq.num_computed, len(seq))
        return logits

    def _ready(self, seq: Sequence, start: int, end: int) -> list[int]:
        """The block ids a step computing ``start .. end`` reads; the sequence's window made first
        if it has none of its own (a stale window's rows were taken by a newer one)."""
        if seq.window is None or not seq.window.current:
            seq.window = self.kv.window_for(seq.token_ids, start)
        return [b.id for b in seq.blocks[:self.manager.blocks_needed(end)]]

    def _computed(self, seq: Sequence, start: int, end: int) -> None:
        seq.num_computed, seq.ring_clean = end, True
        if seq.window is not None and start < seq.window.sinks:
            self.kv.remember_sinks(seq.token_ids, seq.window)
