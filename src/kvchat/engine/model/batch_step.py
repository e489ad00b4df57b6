"""The decode step of several sequences at once: one token of each, in one forward.

Decode reads every weight once per step, whatever the number of rows, so a step of 8 sequences
costs far less than 8 steps of one. Each row keeps its own position, slot, block table and length;
attention runs per row (the op, a ``BatchMeta``) or, for an fp16 pool on the CPU's compiled step,
as plain torch ops over a padded ``[rows, blocks]`` table (``kernels.traced``).

On the CPU the compiled graphs have static row counts, ``BUCKETS``: a batch is padded up to its
bucket, over a pool that takes nothing (the op) or by repeating its first row (traced attention:
the same K/V to the same slot). Each bucket's graph is
compiled on the step's compile thread the first time a batch of its size runs, in an idle moment
(``prepare``); until then the batch runs eagerly, which already shares the weight reads. On CUDA
the batch runs eagerly: capturing graphs per batch bucket is left for a GPU to measure.
"""
import torch

from kvchat.kernels.reference import consecutive_start

from kvchat.core.config import MAX_RUNNING
from kvchat.engine.model.attention import BatchMeta, StepMeta, running
from kvchat.engine.model.background_compile import graph_kind, run_on_stand_ins, unread_meta
from kvchat.engine.model.decode_step import DecodeStep, compiled, lm_logits

BUCKETS = (2, 4, 8, MAX_RUNNING)
TABLE_STEP = 4  # a compiled batch's block table widens 4 blocks at a time: few shapes, little padding


def batch_step_for(single: DecodeStep) -> "BatchStep":
    """One per single step (so per model and mode): its graphs are compiled once."""
    if not hasattr(single, "batch"):
        single.batch = BatchStep(single)
    return single.batch


def bucket_for(rows: int) -> int:
    return next(b for b in BUCKETS if b >= rows)


class BatchStep:
    def __init__(self, single: DecodeStep):
        self.single = single
        self.model, self.decoder, self.device = single.model, single.decoder, single.device
        self._compiled: dict[int, object] = {}  # bucket -> its compiled forward
        self.wanted: set[int] = set()  # buckets a batch has run in: compiled when the engine is idle
        self.replays = 0

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: dict | None = None) -> torch.Tensor:
        """fp32 logits ``[rows, vocab]``, one row per sequence."""
        hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False,
                              kvchat_step=step).last_hidden_state
        return lm_logits(self.model, hidden[:, -1])

    def __call__(self, kv, rows: list[tuple]) -> torch.Tensor:
        """fp32 logits ``[len(rows), vocab]``. ``rows``: per sequence ``(window, token, position,
        slot, block ids)``; each token's K/V go to its slot of ``kv``."""
        n = len(rows)
        if n > MAX_RUNNING:
            raise ValueError(f"a batched step takes at most {MAX_RUNNING} sequences, not {n}")
        bucket = bucket_for(n)
        self.wanted.add(bucket)
        kind = self.kind(kv, bucket)
        compiled = self.device.type == "cpu" and self.single.captured and kind in self.single.background.ready
        if compiled and all(self.single.replayable(r[0], r[2]) for r in rows):  # else the op refuses or stores
            return self._compiled_step(kv, rows, bucket)[:n]
        ids, positions, metas = self._inputs(kv, rows, n)
        with running(BatchMeta(metas)):
            return self.forward(ids, positions)

    def _inputs(self, kv, rows: list[tuple], size: int):
        """The step's tensors for ``size`` rows, padded past ``rows`` with rows over a pool that
        takes nothing. Plain tensors, as the compiled graph was traced on (``run_on_stand_ins``)."""
        dev = self.device
        ids, positions = self._tokens(rows + [(None, 0, 0, -1, [])] * (size - len(rows)))
        metas = [StepMeta(kv=kv, slots=torch.tensor([slot], device=dev),
                          block_table=torch.tensor(block_ids, dtype=torch.int32, device=dev),
                          context_len=position + 1, first_block=consecutive_start(block_ids), window=window)
                 for window, _, position, slot, block_ids in rows]
        return ids, positions, metas + [unread_meta(dev)] * (size - len(rows))

    def _tokens(self, rows: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode(False):
            return (torch.tensor([[r[1]] for r in rows], device=self.device),
                    torch.tensor([[r[2]] for r in rows], device=self.device))

    def _compiled_step(self, kv, rows: list[tuple], bucket: int) -> torch.Tensor:
        forward = self._forward_for(bucket)
        self.replays += 1
        if graph_kind(kv) == "op":
            ids, positions, metas = self._inputs(kv, rows, bucket)
            with running(BatchMeta(metas)):
                return forward(ids, positions)
        # a padding row repeats the first: the same K/V to the same slot (a row of its own at slot
        # -1 would rewrite slot 0 with its old rows, in a race with a sequence writing there)
        rows = rows + [rows[0]] * (bucket - len(rows))
        ids, positions = self._tokens(rows)
        width = max(2, -(-max(len(r[4]) for r in rows) // TABLE_STEP) * TABLE_STEP)
        with torch.inference_mode(False):
            table = torch.zeros(bucket, width, dtype=torch.long, device=self.device)
            for i, r in enumerate(rows):
                table[i, :len(r[4])] = torch.tensor(r[4])
            slots = torch.tensor([r[3] for r in rows], device=self.device)
            lengths = torch.tensor([r[2] + 1 for r in rows], dtype=torch.int32, device=self.device)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        return forward(ids, positions, {"layers": kv.layers, "slot": slots, "table": table, "length": lengths})

    def compiled_rows(self, kv, want: int) -> int:
        """The most rows a batch runs compiled now on the CPU (an eager batch of 16 rows cost
        several compiled single steps: a speculative check there lost more than it kept); the
        bucket of ``want`` rows is wanted, compiled in a next idle moment. Where nothing
        compiles, the largest."""
        if self.device.type != "cpu" or not self.single.captured:
            return MAX_RUNNING
        if want > 1:
            self.wanted.add(bucket_for(min(want, MAX_RUNNING)))
        return max((b for b in BUCKETS if self.kind(kv, b) in self.single.background.ready), default=1)

    def kind(self, kv, bucket: int) -> str:
        return f"{graph_kind(kv)}x{bucket}"

    @staticmethod
    def owns(job: str) -> bool:
        """Is this compile job one of a batch's graphs (``kind``)?"""
        return job.rpartition("x")[2].isdigit()

    def prepare(self, kv) -> bool:
        """Queue on the compile thread the graphs of the buckets batches have used, once the
        single step's graph for this pool is ready; True when one was queued now."""
        if self.device.type != "cpu" or not self.single.captured:
            return False
        if graph_kind(kv) not in self.single.background.ready:
            return False
        todo = [b for b in sorted(self.wanted) if not self.single.background.known(self.kind(kv, b))]
        if not todo:  # asked every idle second
            return False
        layers = [{name: (t.shape[1:], t.dtype) for name, t in layer.items()} for layer in kv.layers]
        for bucket in todo:
            self.single.background.want(self.kind(kv, bucket), lambda b=bucket: run_on_stand_ins(
                self._forward_for(b), graph_kind(kv), layers, self.device, b))
        return True

    def _forward_for(self, bucket: int):
        """One compiled object per bucket: each keeps its own few graphs (fp16, quantized) under
        dynamo's recompile limit."""
        if bucket not in self._compiled:
            self._compiled[bucket] = compiled(self.forward, self.device)
        return self._compiled[bucket]
