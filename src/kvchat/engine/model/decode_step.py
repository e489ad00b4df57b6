"""The decode step, one token in and its logits out, run eager, compiled or replayed.

Per token, an eager transformers forward costs more in Python and kernel launches than the weights
cost to read. So the step's inputs live in tensors allocated once and updated in place, the paged
attention is one custom op (``attention.paged_attention``), and the forward is
- on the CPU, compiled by inductor on a thread of its own (``background_compile``) while the step
  runs eagerly, then used from the next token on (artefacts cached on disk, so a second start
  compiles in seconds), with an fp16 pool's attention as plain torch ops (``kernels.traced``) that
  inductor fuses into the step's loops, reading the step's slot, block table and length from
  tensors. One graph per kind of pool (fp16: traced; quantized: the op), whatever its size;
- on CUDA, captured as a CUDA graph per block-table bucket and replayed. The graph replays
  without Python, so attention reads the length, the padded block table and the window's bounds
  from tensors this step updates; the window's Python bookkeeping is done here around the replay.
  A graph reads the window's rows, which the pool owns and every new sequence takes over, so a
  new reply replays the graphs the last one captured.
When compiling fails, the step falls back to eager and says why once (``fallback``); a failed
capture decodes eagerly until the next idle moment, is tried once more then, and only a second
failure falls back for good.
"""
import inspect
import logging
import weakref

import torch

from kvchat.kernels.reference import consecutive_start, soft_cap

from kvchat.engine.model.attention import StepMeta, running
from kvchat.engine.model.background_compile import BackgroundCompile, graph_kind, run_on_stand_ins
from kvchat.engine.model.weights import warm_up as warm_weights
from kvchat.core.config import DECODE_MODES
from kvchat.core.kv_sizes import config_value
from kvchat.core.errors import first_line
from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

log = logging.getLogger("kvchat.decode")
# block-table lengths (blocks) of the captured graphs, doubling: a table padded to its bucket reads
# at most twice its blocks' ids (quadrupling put 32k tokens in the 8,192-block bucket: 6,144 idle)
BUCKETS = tuple(32 << i for i in range(11))


def decode_step_for(model, mode: str = "auto") -> "DecodeStep":
    """One step per model and mode, shared by every pool built on that model: compiling is paid
    once. Kept on the model, so it goes when the model goes (a model switch frees both)."""
    steps = model.__dict__.setdefault("_kvchat_decode_steps", {})
    if mode not in steps:
        steps[mode] = DecodeStep(model, mode)
    return steps[mode]


def lm_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``hidden`` rows, soft-capped as the model's own head caps them (Gemma 2's
    ``final_logit_softcapping``): the engine calls the head itself, not the model's forward."""
    return soft_cap(model.lm_head(hidden).float(), config_value(model.config, "final_logit_softcapping"))


class DecodeStep:
    def __init__(self, model, mode: str = "auto"):
        if mode not in DECODE_MODES:
            raise ValueError(f"decode mode must be one of {', '.join(DECODE_MODES)}, not {mode!r}")
        self.model = model
        self.decoder = getattr(model, model.base_model_prefix)
        self.device = next(model.parameters()).device
        self.fallback: str | None = None  # why a compiled mode fell back to eager
        if mode == "auto":
            mode, self.fallback = "compiled", None if self.device.type == "cuda" else cpu_compile_missing()
        self.mode = mode
        dev = self.device
        with torch.inference_mode(False):  # plain, as the stand-ins the graph compiles on (run_on_stand_ins)
            self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
            self.positions = torch.zeros(1, 1, dtype=torch.long, device=dev)
            self.slots = torch.full((1,), -1, dtype=torch.long, device=dev)
            self.lens = torch.ones(1, dtype=torch.int32, device=dev)
            self.wmeta = torch.full((4,), -1, dtype=torch.int32, device=dev)  # dispatch.window_meta's values
        self._compiled = None
        self.background = BackgroundCompile(self._fall_back)
        self._traced_table = IdBuffer(torch.long, dev, 64)  # the CPU's compiled step's block table
        # the op's and the graphs' (which read views of it: made once at the largest bucket on CUDA)
        self._table = IdBuffer(torch.int32, dev, BUCKETS[-1] if dev.type == "cuda" else 64)
        self._bounds = PinnedCopy(self.wmeta)
        self._graphs: dict[tuple, tuple] = {}  # (window storage's id, bucket) -> (graph, logits)
        # a failed capture (an out-of-memory moment, a kernel's first compile) is tried again once,
        # at the next idle moment (retry_capture); until then and after a second failure, eager
        self.capture_failed: str | None = None
        self._failed_bucket = 1
        self._capture_retried = False
        self._graph_kv = None  # the pool the graphs were captured on
        self.replays = 0

    @property
    def captured(self) -> bool:
        return self.mode == "compiled" and self.fallback is None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, step: dict | None = None) -> torch.Tensor:
        """The eager step: fp32 logits ``[1, vocab]`` of the last position. ``step``
        (``traced_inputs``) makes attention plain torch ops instead of the op."""
        hidden = self.decoder(input_ids=ids, position_ids=positions, use_cache=False,
                              kvchat_step=step).last_hidden_state
        return lm_logits(self.model, hidden[0, -1:])

    def __call__(self, kv, window, token: int, position: int, slot: int, block_ids: list[int]) -> torch.Tensor:
        """fp32 logits ``[vocab]`` of ``token`` at ``position``, its K/V written to ``slot`` of ``kv``
        (``window``: the sequence's full-precision window in a quantized mode). The step's values
        reach its tensors by fills and its block table by the ids that changed: on CUDA a copy from
        the host's pageable memory waits for the GPU, and five a step did."""
        self._set(token, position, slot)
        if self.captured and self.replayable(window, position):
            if self.device.type == "cuda":
                return self._replay(kv, window, token, position, slot, block_ids)
            logits = self._compiled_step(kv, window, block_ids, position)
            if logits is not None:
                return logits
        with running(self._meta(kv, window, block_ids, position)):
            return self.forward(self.ids, self.positions)[0]

    def _compiled_step(self, kv, window, block_ids: list[int], position: int) -> torch.Tensor | None:
        """The CPU's compiled step, or None (run eagerly) until its graph is ready. Its compile is
        the host's to start (prepare): one started here began before a reply's first token (a
        prompt whose last token is a decode step), unannounced."""
        if graph_kind(kv) not in self.background.ready:
            return None
        try:
            if graph_kind(kv) == "traced":
                logits = self._compiled_forward()(self.ids, self.positions, self.traced_inputs(kv, block_ids))[0]
            else:
                with running(self._meta(kv, window, block_ids, position)):
                    logits = self._compiled_forward()(self.ids, self.positions)[0]
        except NotImplementedError:  # the op refusing this step, compiled or not
            raise
        except Exception as e:  # the graph compiled but cannot run here: eager still works
            if self.replays:
                raise
            self._fall_back(e)
            return None
        self.replays += 1
        return logits

    def _set(self, token: int, position: int, slot: int) -> None:
        self.ids.fill_(token)
        self.positions.fill_(position)
        self.slots.fill_(slot)
        self.lens.fill_(position + 1)

    def _meta(self, kv, window, block_ids: list[int], position: int) -> StepMeta:
        """The step as the attention op takes it, on this step's tensors."""
        return StepMeta(kv=kv, slots=self.slots, block_table=self._device_table(block_ids), context_len=position + 1,
                        first_block=consecutive_start(block_ids), window=window, context_lens=self.lens)

    def _device_table(self, block_ids: list[int]) -> torch.Tensor:
        """``block_ids`` as int32 on the device; a new buffer drops the graphs, which read the old."""
        if self._table.hold(block_ids):
            self._graphs.clear()
        return self._table.buffer[:len(block_ids)]

    def traced_inputs(self, kv, block_ids: list[int]) -> dict:
        """What ``attention.traced_step`` reads, each in a tensor updated in place: the slot, the
        block table (a view, at least 2 long so that its length is never specialized as 1) and the
        length. The table's length and the pool's size are dynamic dimensions (``run_on_stand_ins``):
        one graph serves every context and pool (it cost a first compile 103 s against 89 s)."""
        self._traced_table.hold(block_ids)
        table = self._traced_table.buffer[:max(len(block_ids), 2)]
        torch._dynamo.maybe_mark_dynamic(table, 0)
        return {"layers": kv.layers, "slot": self.slots, "table": table, "length": self.lens}

    def replayable(self, window, position: int) -> bool:
        """Not a sink position, which is stored from Python."""
        return window is None or position >= window.sinks

    def prepare(self, kv) -> bool:
        """Start compiling on the compile thread what decoding on ``kv`` needs: the int8 weights'
        eager paths, then the step's graph for this kind of pool; True when the graph's compile
        was queued now. CUDA captures on the engine thread (``warm_up``)."""
        self.background.want("weights", lambda: warm_weights(self.model))
        kind = self.graph_wanted(kv)
        if kind is None:  # every token asks: nothing more to do
            return False
        layers = [{name: (t.shape[1:], t.dtype) for name, t in layer.items()} for layer in kv.layers]
        return self.background.want(kind, lambda: self._compile(kind, layers))

    def _compile(self, kind: str, layers: list[dict]) -> None:  # a test holds it
        run_on_stand_ins(self._compiled_forward(), kind, layers, self.device)

    def graph_wanted(self, kv) -> str | None:
        """The kind of graph decoding on ``kv`` still needs compiled on the CPU, or None."""
        kind = graph_kind(kv)
        return kind if self.captured and self.device.type == "cpu" and not self.background.known(kind) else None

    def warm_up(self, kv, blocks: int = 1) -> None:
        """On CUDA, capture the bucket of ``blocks`` now (the smallest: so that the first reply does
        not wait for it; the quantized window variant's kernels took 35 s to compile for sm_89): on
        a step that writes nowhere (slot -1, ring row -1), reads block 0, and borrows the pool's
        window rows."""
        if not self.captured or self.device.type != "cuda":
            return
        window = kv.new_window(take=False)
        with torch.inference_mode():
            self._device_table([0] * blocks)
            self._graph(kv, window, blocks, window.sinks if window is not None else 0)

    def _fall_back(self, error: Exception) -> None:
        self.fallback = f"decoding without compilation ({type(error).__name__}: {first_line(error)})"
        log.warning("%s", self.fallback)

    def _compiled_forward(self):
        if self._compiled is None:
            self._compiled = compiled(self.forward, self.device)
        return self._compiled

    # -- CUDA graphs --

    def _replay(self, kv, window, token: int, position: int, slot: int, block_ids: list[int]) -> torch.Tensor:
        self._device_table(block_ids)
        captured = self._graph(kv, window, len(block_ids), position)
        if captured is None:
            with running(self._meta(kv, window, block_ids, position)):
                return self.forward(self.ids, self.positions)[0]
        self._set(token, position, slot)  # a capture writes its own
        graph, logits = captured
        if window is not None:  # what the op's write and attend would do in Python, done here
            for layer in range(len(window.end)):
                window.note(layer, position, 1)
            bounds = (*window.bounds(0, position + 1), window.ring_row(position), position)
            self._bounds.copy(bounds)
        graph.replay()
        self.replays += 1
        return logits[0].clone()

    def _graph(self, kv, window, blocks: int, position: int) -> tuple | None:
        """The graph for a table of ``blocks`` on these tensors, captured now if need be; None:
        run eagerly (past the last bucket, or the capture failed). Graphs are kept per window
        storage: a sequence decoding alone on rows of its own (it began while another ran) has its
        graphs, and the next reply on the pool's rows replays the pool's again, not captured anew
        each time decoding goes from a batch back to one sequence. A storage's graphs go with it."""
        storage = window.storage if window is not None else None
        if self._graph_kv is not kv:  # another pool: other tensors
            self._graphs.clear()
            self._graph_kv = kv
        bucket = next((b for b in BUCKETS if b >= blocks), None)
        if bucket is None:
            return None
        key = (id(storage), bucket)
        if key not in self._graphs:
            if self.capture_failed is not None:
                return None
            try:
                self._graphs[key] = self._capture(kv, window, position, bucket)
            except Exception as e:
                if self._capture_retried:
                    self._fall_back(e)
                else:
                    self.capture_failed, self._failed_bucket = f"{type(e).__name__}: {first_line(e)}", bucket
                    log.warning("capturing the decode step failed (%s): eager until the next idle moment, "
                                "then once more", self.capture_failed)
                return None
            if storage is not None and storage is not kv.window_storage:
                weakref.finalize(storage, self._drop_graphs, id(storage))
        return self._graphs[key]

    def _drop_graphs(self, storage_id: int) -> None:
        for key in [k for k in self._graphs if k[0] == storage_id]:
            del self._graphs[key]

    def retry_capture(self, kv) -> str | None:
        """The one retry of a failed capture, in an idle moment: returns the first failure's reason
        (None: nothing to retry). Failing again, the step decodes eagerly for good (``fallback``)."""
        if self.capture_failed is None or self._capture_retried:
            return None
        reason, self.capture_failed, self._capture_retried = self.capture_failed, None, True
        self.warm_up(kv, self._failed_bucket)
        return reason

    def _capture(self, kv, window, position: int, bucket: int) -> tuple:
        """Record the step for block tables up to ``bucket`` blocks (a view of the step's table
        buffer). Warm-up and capture write to slot -1 and ring row -1, which the write kernel skips,
        so they leave the pool and the window untouched; the window's bookkeeping, which the op's
        Python updates as it records, is put back after."""
        length = position + 1 if window is not None else 1  # a window is recorded at its own place
        meta = StepMeta(kv=kv, slots=self.slots, block_table=self._table.buffer[:bucket], context_len=length,
                        context_lens=self.lens, window=window, window_meta=self.wmeta if window is not None else None)
        self.slots.fill_(-1)
        self.lens.fill_(length)
        self.wmeta.copy_(torch.tensor([0, 0, -1, -1], dtype=torch.int32))
        kept = (list(window.start), list(window.end), list(window.sink_len)) if window is not None else None
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), running(meta):
                for _ in range(2):  # compiles the Triton kernels and settles the allocator
                    self.forward(self.ids, self.positions)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            if not hasattr(self, "_pool"):
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool), running(meta):
                logits = self.forward(self.ids, self.positions)
        finally:
            if kept is not None:
                window.start, window.end, window.sink_len = kept
        return graph, logits


def compiled(forward, device):
    """``forward`` as the decode steps compile it."""
    use_disk_cache()
    # the weights never change under a step (another mode or model is another step), so
    # checking ~300 parameter guards per token is pure cost: 1.5 ms a token measured. Then
    # the compiled code must not be shared by steps of other models: every step's forward
    # is the same code object, and dynamo caches per code object unless told to isolate
    # On the CPU inductor inlines a pointwise producer into its consumers up to 50 ops: the
    # query's RoPE (a sin and a cos) was recomputed for every key attention reads, 30% of a
    # starter token. Below 8 ops the query is computed once; 61 -> 86 tok/s measured. The
    # graph's ~550 input size asserts (1 ms a token) repeat what dynamo's guards check.
    options = {"realize_cpu_opcount_threshold": 8, "size_asserts": False} if device.type == "cpu" else {}
    kwargs = {}
    if "isolate_recompiles" in inspect.signature(torch.compile).parameters:
        options["guard_filter_fn"] = torch.compiler.skip_guard_on_all_nn_modules_unsafe
        kwargs["isolate_recompiles"] = True
    return torch.compile(forward, fullgraph=True, dynamic=False, options=options, **kwargs)


class IdBuffer:
    """Block ids in a tensor kept across steps, where only the ids that changed since the last call
    are written: a decode step adds one block every block-size tokens (a fill), a new sequence or
    a moved block rewrites from the first difference. On CUDA a copy from the host's pageable
    memory waits for the GPU; a fill does not."""

    def __init__(self, dtype: torch.dtype, device, min_size: int):
        self.dtype, self.device, self.min_size = dtype, device, min_size
        self.buffer, self.ids = None, []

    def hold(self, block_ids: list[int]) -> bool:
        """Put ``block_ids`` at the buffer's start; True when the buffer was made anew (it doubles)."""
        n, old = len(block_ids), self.ids
        made = self.buffer is None or n > self.buffer.numel()
        if made:
            with torch.inference_mode(False):  # plain, as the step's other tensors (DecodeStep.__init__)
                self.buffer = torch.zeros(max(2 * n, self.min_size), dtype=self.dtype, device=self.device)
            old = []
        if old[:n] != block_ids:
            same = next((i for i, (a, b) in enumerate(zip(old, block_ids)) if a != b), min(len(old), n))
            if n - same == 1:
                self.buffer[same].fill_(block_ids[same])
            else:
                self.buffer[same:n].copy_(torch.tensor(block_ids[same:], dtype=self.dtype))
        self.ids = list(block_ids)
        return made


class PinnedCopy:
    """Host values into a CUDA tensor without waiting for the GPU: through two pinned buffers taken
    in turn. A buffer is rewritten only once the copy that read it two calls ago has left (its
    event), never while the copy just queued may be pending."""

    def __init__(self, target: torch.Tensor):
        self.target = target
        pinned = target.device.type == "cuda"
        self._host = [torch.empty(target.shape, dtype=target.dtype, pin_memory=pinned) for _ in range(2)]
        self._copied: list = [None, None]
        self._turn = 0

    def copy(self, values: tuple) -> None:
        turn = self._turn = 1 - self._turn
        if self._copied[turn] is not None:
            self._copied[turn].synchronize()  # the copy of two calls ago: long gone, in practice
        host = self._host[turn]
        host.copy_(torch.tensor(values, dtype=host.dtype))
        self.target.copy_(host, non_blocking=True)
        event = self._copied[turn] or torch.cuda.Event()
        event.record()
        self._copied[turn] = event
