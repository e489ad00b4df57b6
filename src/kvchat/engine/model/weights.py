"""Weight-only quantization on the CPU.

Decode on the CPU is bound by reading the weights: each token reads every linear layer once.
int8 (groups of 32, a bf16 scale each) reads 0.27 of fp32's bytes, int4 (groups of 32 with a scale
and a minimum, the layout of GGUF's Q4_1) about 0.16, both through kvchat's kernel where it runs
(``kernels/int8_rows.cpp``), else inductor's int8 loops and torch's packed int4 kernel. The rest of
the model (norms, residual stream, KV) keeps the model's dtype. The tied input embedding stays as
it is (a lookup reads one row); the output head gets its own quantized copy.
"""
import functools
import logging
import threading

import torch
from torch import nn

from kvchat.engine.model.fused_linears import fuse_groups
from kvchat.engine.model.kernel_build import build_kernel, build_kernel_soon, kernel_runs_here
from kvchat.kernels import int8_rows

log = logging.getLogger("kvchat.weights")

INT8_GROUP = 32
INT4_GROUP = 32
_ACT = torch.bfloat16  # what torch's int4 kernel takes


class Int8Linear(nn.Module):
    """``x @ W.T`` with W stored as int8 in groups of ``INT8_GROUP`` along the input, one scale each.

    Per output channel (what ``torch.ops.aten._weight_int8pack_mm`` takes, with bf16 activations)
    cost +0.6% perplexity on the starter, over the +0.5% bar; groups of 32 measured -0.1% (noise).
    Where the CPU has AVX-512 VNNI and a compiler, every product runs kvchat's kernel
    (``kernels/int8_rows.cpp``, the codes packed for it): 8 rows of the starter in half the time of
    inductor's fused loop, a prefill chunk in half that of rebuilding the weight. Elsewhere the
    compiled decode step reads the int8 rows in one pass that inductor fuses (dequantize,
    multiply, sum), and a prefill chunk rebuilds the weight for one matrix product.
    """

    def __init__(self, linear: nn.Linear, packed: bool | None = None):
        """``packed``: the decode kernel's layout (``kernels.int8_rows``); by default where this
        CPU runs the kernel and the shape fits it."""
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // INT8_GROUP, INT8_GROUP)
        low, high = torch.aminmax(groups, dim=-1)  # one pass, no |w| copy: part of every start's load
        scale = (torch.maximum(-low, high) / 127).clamp_(min=1e-12).to(torch.bfloat16).float()
        codes = (groups / scale[..., None]).round_().clamp_(-127, 127).to(torch.int8).view(n, k)
        scale = scale.to(torch.bfloat16)  # exact: the codes were made against these
        if packed is None:
            packed = w.device.type == "cpu" and _kernel_can_run(n, k)
        if packed:
            codes, scale = int8_rows.pack(codes, scale)
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scale)
        self.bias = linear.bias
        self.in_features, self.out_features = k, n

    @property
    def packed(self) -> bool:
        """In the kernel's layout (``int8_rows.pack``), which every path here reads by its 4 dims."""
        return self.qweight.dim() == 4

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        return _dequantized(self.qweight, self.scales, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.packed and int8_rows.built:
            out = torch.ops.kvchat.int8_rows(rows, self.qweight, self.scales).to(rows.dtype)
        else:
            # one row reads the codes once; a chunk's rows share the cost of rebuilding the weight
            product = _row_product if rows.shape[0] == 1 else _rows_product
            if 1 < rows.shape[0] <= BATCH_ROWS and torch.compiler.is_dynamo_compiling():
                product = _batch_product  # a batched decode step's rows, one per sequence
            out = _run(product, rows, self.qweight, self.scales)  # packed: until the kernel is built
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


def _dequantized(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if qweight.dim() == 4:  # packed for the kernel (or a slice of its tiles)
        qweight, scales = int8_rows.unpack(qweight, scales)
    n, k = qweight.shape
    return (qweight.reshape(n, -1, INT8_GROUP).to(dtype) * scales.to(dtype)[..., None]).view(n, k)


def _row_product(row: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``row @ W.T`` for one row ``[1, k]``, read once from the int8 codes: what a compiled step
    fuses into one pass; a matrix product would first write W out in floats (the output head:
    113 MB for one row)."""
    return (row * _dequantized(qweight, scales, row.dtype)).sum(-1)


BATCH_ROWS = 16  # up to this many rows, a compiled step reads the codes once for all of them


def _batch_product(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``rows @ W.T`` for a batched decode step's few rows, each a fused row product over the same
    dequantized weight, which inductor reads once. Compiled, on the starter's output head: 8 rows
    5.9 ms against 4.1 for one; as a matrix product on the rebuilt weight 61 ms."""
    rows = _rows_as_they_are(rows)
    weight = _dequantized(qweight, scales, rows.dtype)
    return torch.stack([(row * weight).sum(-1) for row in rows.unbind(0)])


@torch.library.custom_op("kvchat::rows_as_they_are", mutates_args=())
def _rows_as_they_are(rows: torch.Tensor) -> torch.Tensor:
    """A copy of a batched step's rows (an op may not return its input), opaque to inductor, so
    that the rows are written out once before the products read them. Left to fuse, inductor
    pulled the RMS norm that makes the rows into some of the products, which then ran row by row,
    each reading the weight again through a local buffer: the starter's 8-row graph (attention
    aside) took 50-52 ms a step, 29-30 with this. Only compiled steps reach it."""
    return rows.clone(memory_format=torch.contiguous_format)


@_rows_as_they_are.register_fake
def _(rows: torch.Tensor) -> torch.Tensor:
    return torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)


def _rows_product(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(rows, _dequantized(qweight, scales, rows.dtype))


SLICE_FLOATS = 1 << 18  # an eager product's dequantized slice of the weight: 1 MiB in fp32, in cache


def _in_slices(product, rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``product`` over slices of the weight's output rows. Eager torch writes each step of the
    dequantization out in full: the starter's output head whole (113 MB of floats, fresh pages
    each token) took 124 ms a row, in slices 7-9 ms (its compiled twin 4 ms); so an int8 reply
    decodes at eager speed while its compile runs elsewhere."""
    outputs = int8_rows.TILE if qweight.dim() == 4 else 1  # a packed weight's dim 0 is tiles of 16
    step = max(1, SLICE_FLOATS // (rows.shape[-1] * outputs))
    if qweight.shape[0] <= step:
        return product(rows, qweight, scales)
    return torch.cat([product(rows, qweight[i:i + step], scales[i:i + step])
                      for i in range(0, qweight.shape[0], step)], -1)


_warming = threading.local()  # set on the thread that runs warm_up: it may compile


def _run(fn, *args):
    """Inside a compiled step ``fn`` is traced into the step's own code; eagerly, its compiled twin
    runs once ``warm_up`` compiled it (on the decode step's compile thread), ``fn`` in slices until
    then: the engine thread never waits for a compile."""
    if torch.compiler.is_dynamo_compiling():  # not is_compiling(): a global flag, True on every thread
        return fn(*args)                         # while the compile thread traces, so eager lost its twin
    if getattr(_warming, "on", False):
        return fused(fn)(*args)
    twin = _ready_twins.get(fn)  # never fused() here: its first call imports inductor, 1.7 s of a first token
    return twin(*args) if twin is not None else _in_slices(fn, *args)


_ready_twins = {}  # fn -> its compiled twin, once warm_up compiled it for the model's shapes


@functools.cache
def fused(fn):
    """``fn`` compiled by inductor for every shape, once a process (the conversion from int8 and
    the scaling in one pass instead of three in eager torch: an 18-token prefill of the starter
    230 -> 132-149 ms, fp32 weights 106-127), or ``fn`` itself where inductor cannot compile here."""
    from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

    if cpu_compile_missing() is not None:
        return _FirstCallGuard(fn, None)
    use_disk_cache()
    return _FirstCallGuard(fn, torch.compile(fn, dynamic=True))


@torch.inference_mode()
def warm_up(model: nn.Module) -> None:
    """Compile the eager int8 paths (a chunk's rows, one row) for each shape of the model's int8
    linears, so that the first reply does not wait for it (about 5 s cold, on disk after); build
    the CPU kernels' library where a step will call it."""
    shapes = {}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            shapes.setdefault(module.qweight.shape, module)
    first = next(model.parameters())
    dtype = first.dtype
    # the library also holds an fp32 pool's decode attention (kernels/cpu_attention), which a
    # compiled step of the checkpoint's own fp32 weights calls too
    if any(m.packed for m in shapes.values()) or (first.device.type == "cpu" and dtype == torch.float32):
        build_kernel()
    _warming.on = True
    try:
        for module in shapes.values():  # the kernel, where it is built, takes every row
            for rows in () if module.packed and int8_rows.built else (2, 1):
                module(torch.zeros(rows, module.in_features, dtype=dtype, device=module.qweight.device))
    finally:
        _warming.on = False
    if shapes:
        _ready_twins.update({fn: fused(fn) for fn in (_row_product, _rows_product)})


def _kernel_can_run(n: int, k: int) -> bool:
    return int8_rows.fits(n, k) and int8_rows.cpu_supported() and kernel_runs_here()


class _FirstCallGuard:
    """Runs the compiled twin of ``fn``; if compiling fails (it happens at the first call), runs
    ``fn`` from then on and says why once."""

    def __init__(self, fn, compiled):
        self.fn, self.compiled = fn, compiled

    def __call__(self, *args):
        if self.compiled is None:
            return self.fn(*args)
        try:
            return self.compiled(*args)
        except Exception as error:  # noqa: BLE001 - any compile failure: eager is always right
            log.warning("int8 weights without compilation (%s: %s)", type(error).__name__, error)
            self.compiled = None
            return self.fn(*args)


class Int4Linear(nn.Module):
    """``x @ W.T`` with W in groups of ``INT4_GROUP`` along the input: ``w = (q - 8) * scale + zero``,
    ``q`` in 0..15, as torch's packed kernel computes it (bf16 scale and zero, bf16 activations).

    A model read from a Q4_1 GGUF already holds such values (``w = q * d + m``): its codes are
    found again exactly (``_codes``), so only the kernel's bf16 rounding of d and m is lost.
    Quantizing by each group's min and max instead moved many codes (+5.5% perplexity on the
    starter, with the Q8_0 head in int4 too)."""

    def __init__(self, linear: nn.Linear, inner_k_tiles: int = 2, packed: bool | None = None):
        """``packed``: kvchat's kernel (``kernels.int8_rows.int4_rows``: int16 rows, integer sums,
        every row count) in its layout; by default where this CPU runs it and the shape fits.
        Else torch's packed int4 kernel, which takes bf16 rows."""
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        q = _codes(groups)
        scale, zero = _fit(groups, q - 8)
        if packed is None:  # built, not only buildable: without it packed 4-bit codes have no fast path
            packed = w.device.type == "cpu" and _kernel_can_run(n, k) and int8_rows.built
        self.packed = packed
        if packed:
            codes, scales, zeros = int8_rows.pack4(q.view(n, k), scale, zero)
            self.register_buffer("qweight", codes)
            self.register_buffer("scales", scales)
            self.register_buffer("zeros", zeros)
        else:
            self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                q.view(n, k).to(torch.int32), inner_k_tiles))
            self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous())
        self.bias = linear.bias
        self.in_features, self.out_features = k, n

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.packed:
            raise NotImplementedError("torch's int4 layout is not read back")
        codes, scales, zeros = int8_rows.unpack4(self.qweight, self.scales, self.zeros)
        n, k = codes.shape
        w = (codes - 8).view(n, -1, INT4_GROUP).float() * scales.float()[..., None] + zeros.float()[..., None]
        return w.view(n, k).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.packed:
            out = torch.ops.kvchat.int4_rows(flat, self.qweight, self.scales, self.zeros).to(x.dtype)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat.to(_ACT), self.qweight, INT4_GROUP,
                                                             self.scales_and_zeros).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


def _codes(groups: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 per group: those of a grid ``low + q * step`` that holds every value of the group
    (a Q4_1 block whose codes span ``j`` steps lies on the grid of ``span / j``), else of min-max
    rounding. Tried from the finest grid down, the first that holds the group wins."""
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    span = (high - low).clamp(min=1e-30)
    codes = torch.round((groups - low) / span * 15)
    found = torch.zeros_like(low, dtype=torch.bool)
    for steps in range(15, 0, -1):
        step = span / steps
        q = torch.round((groups - low) / step)
        exact = ((q * step + low - groups).abs() <= 1e-5 * step).all(-1, keepdim=True)
        codes = torch.where(exact & ~found, q, codes)
        found |= exact
    return codes.clamp(0, 15)


def _fit(groups: torch.Tensor, centred: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 scale and zero for fixed codes: least squares for the scale, rounded, then the zero
    that best fits with that rounded scale, rounded."""
    c = centred - centred.mean(-1, keepdim=True)
    scale = ((c * groups).sum(-1) / (c * c).sum(-1).clamp(min=1e-30)).to(_ACT)
    zero = (groups - centred * scale.float()[..., None]).mean(-1).to(_ACT)
    return scale, zero


def quantize_linears(model: nn.Module, mode: str) -> nn.Module:
    """Replace every ``nn.Linear`` (the output head included) by its ``mode`` twin, in place."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"weight mode must be int8 or int4, not {mode!r}")
    make = Int8Linear if mode == "int8" else Int4Linear
    group = INT8_GROUP if mode == "int8" else INT4_GROUP
    rows = 16 if mode == "int4" else 1  # torch's int4 packing tiles output rows by 16
    bad = [n for n, m in model.named_modules()
           if isinstance(m, nn.Linear) and (m.in_features % group or m.out_features % rows)]
    if bad:
        raise ValueError(f"{mode} weights need input sizes divisible by {group}"
                         + (f" and output sizes by {rows}" if rows > 1 else "") + f": {bad[0]} is not")
    head = model.get_output_embeddings()
    if head is not None and head.weight.device.type == "cpu":
        if mode == "int4":
            build_kernel()  # now (seconds once, then cached): 4-bit codes are packed only for a built kernel
        fits = _kernel_can_run if mode == "int8" else (lambda n, k: _kernel_can_run(n, k) and int8_rows.built)
        fuse_groups(model, fits, make)  # q/k/v and gate/up as one kernel call each
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                # the head stays int8 in int4 mode: GGUFs keep it at 8 bits or more (the
                # starter's is Q8_0), and 4 bits there cost more than anywhere else
                setattr(module, child_name, Int8Linear(child) if child is head else make(child))
    model.config.tie_word_embeddings = False  # the head is its own tensor now
    build_kernel_soon(model)
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads from weights: every tensor once (tied ones once), but of an input
    embedding that the head does not share, only the one row a step looks up."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    if head is None or head.data_ptr() != embed.data_ptr():
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total
