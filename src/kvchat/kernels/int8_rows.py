"""Rows against int8 weights on the CPU: ``int8_rows.cpp`` and its torch twin.

kvchat's int8 weights are groups of 32 codes along the input, one bf16 scale each. With 8 rows (a
batched step) the product does 8 multiply-adds per weight it reads and is bound by arithmetic:
inductor's fused fp32 loop ran the starter's products in 27-29 ms a step; and on AVX2 its one-row
loops ran 5x slower built by g++ than by clang. The kernel rounds each row to int16 per group of
32 and multiplies in integers: AVX-512 VNNI, AVX-VNNI or AVX2, whichever ``cpu_isa.chosen`` names
(one build holds all three). It needs one of them and a C++ compiler (inductor's, set up by
``engine.toolchain``); without them the weights keep the row-major layout and inductor's product.

4-bit weights run on the same rows and instructions (``int4_rows``): codes 0..15 in groups of 32,
``w = (q - 8) * scale + zero`` with bf16 scale and zero (torch's int4 format, which a GGUF's Q4_1
blocks are found in again), two codes a byte.

The same library holds the fp32 pool's decode attention (``decode_attention.cpp``, whose op is
``cpu_attention``): one build, one prebuilt file, one load.

``torch.ops.kvchat.int8_rows`` is the op a compiled step calls; until the library is built
(``build``, on a thread of the engine's from a model's load on), it runs the twin. A packaged app
carries it prebuilt (``prebuilt``: kernel_build.prebuild, by the bundled clang at packaging time),
so it runs from the first token on a machine without a compiler.
"""
import ctypes
import hashlib
import logging
from pathlib import Path

import torch

from kvchat.kernels import cpu_isa

log = logging.getLogger("kvchat.int8_rows")

TILE = 16  # outputs a 512-bit lane set holds: the packed layout's unit along n
GROUP = 32
_SOURCE = Path(__file__).with_suffix(".cpp")


def sources() -> tuple[Path, Path]:
    """The library's two files: these products and the decode attention (cpu_attention)."""
    return _SOURCE, _SOURCE.with_name("decode_attention.cpp")


def source_text() -> str:
    return "\n".join(path.read_text() for path in sources())


def prebuilt_name() -> str:
    """The prebuilt library's file name, after the source it was built from: a build of other
    source beside it is never loaded."""
    return f"int8_rows-{hashlib.sha256(source_text().encode()).hexdigest()[:16]}.so"


def prebuilt() -> Path | None:
    path = _SOURCE.with_name(prebuilt_name())
    return path if path.is_file() else None


def cpu_supported() -> bool:
    """Does this CPU run one of the kernel's variants (AVX2 and up, or the override's)?"""
    return cpu_isa.chosen() is not None


def fits(n: int, k: int) -> bool:
    return n % TILE == 0 and k % GROUP == 0


def pack(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-major ``codes [n, k]`` int8 and ``scales [n, k/32]`` to the kernel's layouts:
    ``[n/16, k/2, 16, 2]`` and ``[n/16, k/32, 16]``."""
    n, k = codes.shape
    packed = codes.view(n // TILE, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return packed, scales.view(n // TILE, TILE, -1).transpose(1, 2).contiguous()


def unpack(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack``'s inverse (copies: the packed dims never merge back into a view)."""
    tiles, half, _, _ = packed.shape
    codes = packed.permute(0, 2, 1, 3).reshape(tiles * TILE, half * 2)
    return codes, scales.transpose(1, 2).reshape(tiles * TILE, -1)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's rounding of the rows: int16 codes ``[m, k]`` and a scale per group of 32."""
    groups = x.float().view(x.shape[0], -1, GROUP)
    top = groups.abs().amax(-1, keepdim=True)
    # a true division, as the kernel's (``32767 / top`` is a reciprocal and a product in torch);
    # a group under 1e-30 is 0: 32767 / top overflows to inf below about 1e-34 (and 0 * inf is
    # NaN); the margin costs nothing, as such rows are 0 at fp32's resolution anyway
    inv = torch.where(top > 1e-30, torch.full_like(top, 32767.0) / top, torch.zeros_like(top))
    codes = torch.round(groups * inv).clamp(-32767, 32767)
    return codes.view(x.shape[0], -1), (top / 32767).squeeze(-1)


def twin(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The kernel in torch: the same int16 rounding, exact integer sums per group, then the scales
    (in float64, so it differs from the kernel only by the kernel's float rounding)."""
    codes, wscales = unpack(packed, scales)
    q, qs = quantize_rows(x)
    m, k = q.shape
    sums = torch.einsum("mgi,ngi->mng", q.double().view(m, -1, GROUP), codes.double().view(codes.shape[0], -1, GROUP))
    return (sums * qs.double()[:, None, :] * wscales.double()[None]).sum(-1).float()


def pack4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Row-major 4-bit ``codes [n, k]`` (0..15, any int dtype) and bf16 ``scales``/``zeros``
    ``[n, k/32]`` to the kernel's layouts: codes ``[n/16, k/4, 16, 2]`` uint8, byte ``(o, t)`` of
    chunk ``c`` holding ``k = 4c + t`` low and ``4c + 2 + t`` high; scales and zeros
    ``[n/16, k/32, 16]``."""
    n, k = codes.shape
    c = codes.to(torch.uint8).view(n // TILE, TILE, k // 4, 2, 2)  # [tiles, o, chunk, high, t]
    packed = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).contiguous()
    tiled = [x.view(n // TILE, TILE, -1).transpose(1, 2).contiguous() for x in (scales, zeros)]
    return packed, *tiled


def unpack4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``pack4``'s inverse: codes ``[n, k]`` int32 (0..15), scales and zeros ``[n, k/32]``."""
    tiles, chunks, _, _ = packed.shape
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    codes = torch.stack([low, high], 3).permute(0, 2, 1, 3, 4).reshape(tiles * TILE, chunks * 4)
    return codes, *(x.transpose(1, 2).reshape(tiles * TILE, -1) for x in (scales, zeros))


def twin4(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``int4_rows`` in torch: the rows' int16 rounding against ``q - 8`` in exact integer sums per
    group, scaled, plus each group's plain sum times its zero (float64)."""
    codes, s, z = unpack4(packed, scales, zeros)
    q, qs = quantize_rows(x)
    m, k = q.shape
    n = codes.shape[0]
    sums = torch.einsum("mgi,ngi->mng", q.double().view(m, -1, GROUP), (codes - 8).double().view(n, -1, GROUP))
    xs = x.float().view(m, -1, GROUP).sum(-1).double()
    return (sums * qs.double()[:, None, :] * s.double()[None] + xs[:, None, :] * z.double()[None]).sum(-1).float()


_lib = None  # the kernel's entry point, once ``build`` succeeded
_lib4 = None
attention = None  # kvchat_decode_attention, likewise (cpu_attention calls it)
built = False  # a plain bool, which a compiled step's guard can check
failed = False
origin = None  # "prebuilt" or "built here", once built
isa = None  # the variant every call runs: cpu_isa.chosen() at the build, or use()'s
_isa_index = -1


def use(name: str) -> None:
    """Run ``name``'s variant from now on (the tests run each ISA this CPU executes)."""
    global isa, _isa_index
    if not cpu_isa.runs(name):
        raise ValueError(f"int8_rows: this CPU cannot run {name}")
    isa, _isa_index = name, cpu_isa.ISAS.index(name)


def _bind(lib: ctypes.CDLL, where: str) -> None:
    global _lib, _lib4, attention, built, origin
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    fn, fn4, attend = lib.kvchat_int8_rows, lib.kvchat_int4_rows, lib.kvchat_decode_attention
    fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i32, i32]
    fn4.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i32, i32]
    attend.argtypes = [ptr, ptr, ptr, ptr, i64, ptr, i64, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i32]
    fn.restype = fn4.restype = attend.restype = ctypes.c_int
    _lib, _lib4, attention, built, origin = fn, fn4, attend, True, where


def load_prebuilt(libomp: Path | None) -> bool:
    """Load the prebuilt library, which needs LLVM's OpenMP (``libomp``, loaded first so that its
    soname answers): False where there is none, or it does not load here."""
    global failed
    path = prebuilt()
    if built or failed or path is None or libomp is None or not cpu_supported():
        return built
    use(cpu_isa.chosen())
    try:
        ctypes.CDLL(str(libomp), mode=ctypes.RTLD_GLOBAL)
        _bind(ctypes.CDLL(str(path)), "prebuilt")
    except OSError as error:  # e.g. an older glibc than the packaging machine's: build it here
        log.warning("prebuilt int8 kernel %s does not load (%s)", path.name, error)
    return built


def build() -> bool:
    """Compile and load the kernel once, with inductor's compiler and caches as the caller set them
    up (a few seconds, then from the disk cache), on a thread that may wait. False where it cannot
    run here."""
    global failed
    if built or failed:
        return built
    if not cpu_supported():
        problem = cpu_isa.override_problem()
        if problem is not None:  # the command line refuses it; the app says so here
            log.warning("%s: no int8 kernel", problem)
        failed = True
        return False
    use(cpu_isa.chosen())
    try:
        from torch._inductor.codecache import CppCodeCache

        _bind(CppCodeCache.load(source_text()), "built here")
    except Exception as error:  # noqa: BLE001 - any build failure: the twin and inductor's product are right
        log.warning("int8 decode kernel not built (%s: %s); inductor's product instead", type(error).__name__, error)
        failed = True
    return built


# Registered with the plain Library API, not custom_op: a compiled step calls it 211 times a token
# on the starter, and custom_op's wrapper cost 2.5 us more a call (8.5 against 6 us, measured).
_library = torch.library.Library("kvchat", "FRAGMENT")
_library.define("int8_rows(Tensor x, Tensor packed, Tensor scales) -> Tensor")
_library.define("int4_rows(Tensor x, Tensor packed, Tensor scales, Tensor zeros) -> Tensor")


def int8_rows(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ W.T`` for ``W`` packed by ``pack``: fp32 ``[m, n]``, the kernel where it is
    built, else its twin."""
    rows = x.float().contiguous()
    m, k = rows.shape
    n = packed.shape[0] * TILE
    # what the kernel trusts: a wrong k reads past the codes, fp32 scales (a module's .float())
    # read as garbage. The full check is the fake's, once at a trace; this one runs every call
    if packed.shape[1] * 2 != k or scales.dtype != torch.bfloat16:
        _check(rows, packed, scales)
    if _lib is None:
        return twin(rows, packed, scales)
    out = torch.empty(m, n, dtype=torch.float32)
    status = _lib(rows.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), n, out.data_ptr(),
                  torch.get_num_threads(), _isa_index)
    if status:
        raise (MemoryError(f"int8_rows: no memory for {m} rows of {k} int16 values") if status == 1
               else ValueError(f"int8_rows: no variant {isa!r}"))
    return out


_library.impl("int8_rows", int8_rows, "CPU")


def int4_rows(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """``x [m, k] @ W.T`` for 4-bit ``W`` packed by ``pack4``: fp32 ``[m, n]``, the kernel where it
    is built, else its twin."""
    rows = x.float().contiguous()
    m, k = rows.shape
    n = packed.shape[0] * TILE
    if packed.shape[1] * 4 != k or scales.dtype != torch.bfloat16 or zeros.dtype != torch.bfloat16:
        _check4(rows, packed, scales, zeros)
    if _lib4 is None:
        return twin4(rows, packed, scales, zeros)
    out = torch.empty(m, n, dtype=torch.float32)
    status = _lib4(rows.data_ptr(), m, k, packed.data_ptr(), scales.data_ptr(), zeros.data_ptr(), n,
                   out.data_ptr(), torch.get_num_threads(), _isa_index)
    if status:
        raise (MemoryError(f"int4_rows: no memory for {m} rows of {k} int16 values") if status == 1
               else ValueError(f"int4_rows: no variant {isa!r}"))
    return out


_library.impl("int4_rows", int4_rows, "CPU")


def _check4(x, packed, scales, zeros) -> None:
    k = x.shape[-1]
    if (x.dim() != 2 or packed.dtype != torch.uint8 or k % GROUP or packed.dim() != 4
            or packed.shape[1:] != (k // 4, TILE, 2) or scales.dtype != torch.bfloat16
            or zeros.dtype != torch.bfloat16 or scales.shape != (packed.shape[0], k // GROUP, TILE)
            or zeros.shape != scales.shape
            or not (packed.is_contiguous() and scales.is_contiguous() and zeros.is_contiguous())):
        raise ValueError(f"int4_rows: rows of {k} against codes {tuple(packed.shape)} {packed.dtype}, scales "
                         f"{tuple(scales.shape)} {scales.dtype}, zeros {tuple(zeros.shape)}: not the layout of pack4()")


@torch.library.register_fake("kvchat::int4_rows")
def _(x, packed, scales, zeros):
    _check4(x, packed, scales, zeros)
    return x.new_empty(x.shape[0], packed.shape[0] * TILE, dtype=torch.float32)


def _check(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> None:
    k = x.shape[-1]
    if (x.dim() != 2 or packed.dtype != torch.int8 or scales.dtype != torch.bfloat16 or k % GROUP
            or packed.dim() != 4 or packed.shape[1:] != (k // 2, TILE, 2)
            or scales.shape != (packed.shape[0], k // GROUP, TILE)
            or not (packed.is_contiguous() and scales.is_contiguous())):
        raise ValueError(f"int8_rows: rows of {k} against codes {tuple(packed.shape)} {packed.dtype} and scales "
                         f"{tuple(scales.shape)} {scales.dtype}, not the layout of pack()")


@torch.library.register_fake("kvchat::int8_rows")
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    _check(x, packed, scales)
    return x.new_empty(x.shape[0], packed.shape[0] * TILE, dtype=torch.float32)
