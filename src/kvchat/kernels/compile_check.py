"""Every Triton kernel variant the engine runs, compiled for a GPU without one: ``triton.compile``
with a ``GPUTarget`` (Triton's wheel carries ptxas), then the cubin's resource use read back with
the wheel's cuobjdump. Registers and spills decide occupancy, and occupancy decides whether a
decode kernel can keep enough bytes in flight to reach the memory bandwidth; a GPU is not needed
to know them. Used by tests/kernels/test_compile.py and ``kvchat bench kernels --compile``.

Run with ``TRITON_INTERPRET`` unset or 0 (in a fresh process under the test suite): the
interpreter replaces ``triton.jit`` functions with objects ``triton.compile`` cannot take.

The budget: the decode kernel runs DECODE_WARPS = 4 warps (128 threads) a program and is designed
for ``triton_decode.PROGRAMS_PER_SM`` = 4 programs an SM (the splits are sized for it). An SM has 64K
32-bit registers, so 4 programs of 128 threads leave 128 registers a thread: ``REGISTER_BUDGET``.
Shared memory is the pipeline's (STAGES tiles of K and V); it is reported, and the programs it
allows per SM are part of the bytes-and-occupancy model (``bench/kernels.py``).
"""
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import triton

from kvchat.core.kv_format import FORMATS, SINKS, WINDOW

# the Triton the stages, tiles and register budgets were tuned on: another one allocates registers
# otherwise, so there its counts are reported, not held to the budgets (spills are a fault anywhere)
TUNED_ON = "3.9"
REGISTER_BUDGET = 128  # 65536 registers / (4 programs x 128 threads)
# the other kernels (write: one token a step; dequantize: a prefill chunk's context; merge) hold no
# pipeline whose depth needs programs: 3 programs of 4 warps an SM
OTHER_REGISTER_BUDGET = 168
TARGETS = (86, 89, 90)
# (name, heads, kv_heads, head_dim): Llama-3.1-8B, Qwen2.5-7B, a 64-dim model (Llama-3.2-1B), and
# Gemma 2 9B (head_dim 256; its local layers' window and its soft cap: the "+band" variants)
SHAPES = (("llama-8b", 32, 8, 128), ("qwen2.5-7b", 28, 4, 128), ("d64", 32, 8, 64), ("gemma2-9b", 16, 8, 256))
BAND = dict(SLIDE=4096, CAP=50.0 * 1.4426950408889634)  # Gemma 2's window and cap, the cap in base 2
PRECISIONS = tuple(FORMATS)  # fp16, int8, fp8, k8v4, int4
SHARED_PER_SM = {86: 100 * 1024, 89: 100 * 1024, 90: 228 * 1024}  # usable per SM, bytes
THREADS_PER_SM = {86: 1536, 89: 1536, 90: 2048}


@dataclass
class Variant:
    name: str
    kernel: str  # the function's name in triton_kv
    signature: dict
    constexprs: dict
    num_warps: int = 4
    pointers: list = field(default_factory=list)  # 16-byte aligned, as every torch allocation is
    fp8: bool = False  # reads fp8 codes: in hardware from sm_89 on, below by bits (``triton_kv.fp8_mode``)


def _ptr(dtype: str) -> str:
    return "*" + dtype


def decode_variants(heads: int, kv_heads: int, head_dim: int, dtype: str = "bf16") -> list[Variant]:
    """The decode kernel as the engine launches it on CUDA (``triton_decode.paged_decode`` from
    ``dispatch``): bf16 model, fp32 rotated query, one sequence; quantized modes with and without
    the window (a prefill chunk's decode-length-1 step and a sink step run without), fp16 without
    (it has none); each again with a layer's band (a sliding window and a soft cap). And the merge,
    for both of its outputs."""
    import triton.language as tl

    from kvchat.kernels import quant
    from kvchat.kernels import triton_decode

    out = []
    group = heads // kv_heads
    for precision in PRECISIONS:
        fmt = quant.FORMATS[precision]
        data = {16: dtype, 8: "u8" if fmt.float8 else "i8", 4: "u8"}
        scales = "*u8" if fmt.float8 else "*fp16"  # fp8 has none: the pool's codes stand in
        tile, stages = triton_decode.decode_config(fmt, head_dim)
        for window, band in [(w, b) for w in ((False, True) if fmt.quantized else (False,)) for b in (False, True)]:
            dot = tl.float16 if fmt.quantized else getattr(tl, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
            wdot = getattr(tl, {"bf16": "bfloat16", "fp16": "float16"}[dtype]) if window else dot
            sig = {"q_ptr": "*fp32", "k_ptr": _ptr(data[fmt.k_bits]),
                   "ks_ptr": "*u8" if fmt.block_keys else scales if fmt.k_bits < 16 else _ptr(data[fmt.k_bits]),
                   "kz_ptr": "*fp16" if fmt.block_keys else _ptr(data[fmt.k_bits]),
                   "steps_ptr": "*fp32", "v_ptr": _ptr(data[fmt.v_bits]), "vs_ptr": scales if fmt.v_bits < 16 else _ptr(data[fmt.k_bits]),
                   "table_ptr": "*i32", "len_ptr": "*i32", "acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32",
                   "wk_ptr": _ptr(dtype if window else data[fmt.k_bits]),
                   "wv_ptr": _ptr(dtype if window else data[fmt.k_bits]),
                   "wmeta_ptr": "*i32", "qk_scale": "fp32", "table_stride": "i32", "splits": "i32"}
            consts = dict(HEADS=heads, KV_HEADS=kv_heads, D=head_dim, BS=16, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits,
                          CH=min(quant.GROUP, head_dim // 2), QG=group,
                          QG_PAD=max(triton_decode.QG_MIN, triton.next_power_of_2(group)), TILE=tile,
                          STAGES=stages, DOT=dot, W_DOT=wdot, PREC="tf32", WINDOW=window,
                          W_SINKS=quant.SINKS if window else 0, W_SIZE=quant.WINDOW if window else 1,
                          **(BAND if band else dict(SLIDE=0, CAP=0.0)), BLOCK_KEYS=fmt.block_keys)
            sig.update({k: "constexpr" for k in consts})
            sig["FP8"] = "constexpr"
            label = f"decode {precision}{' +window' if window else ''}{' +band' if band else ''}"
            out.append(Variant(label, "_paged_decode_kernel", sig,
                               consts, triton_decode.DECODE_WARPS, [k for k, v in sig.items() if v.startswith("*")],
                               fmt.float8))
    for name, out_dtype in (("merge fp32", "fp32"), (f"merge {dtype}", dtype)):
        sig = {"acc_ptr": "*fp32", "m_ptr": "*fp32", "l_ptr": "*fp32", "out_ptr": _ptr(out_dtype), "parts": "i32"}
        consts = dict(D=head_dim, CHUNK=triton_decode.MERGE_CHUNK)
        sig.update({k: "constexpr" for k in consts})
        out.append(Variant(name, "_merge_kernel", sig, consts, 4, [k for k, v in sig.items() if v.startswith("*")]))
    return out


def write_variants(kv_heads: int, head_dim: int, dtype: str = "bf16") -> list[Variant]:
    """The write kernel per stored half: fp16's copy, int8 and fp8 keys (centred), int8, fp8 and
    int4 values; the quantized ones as a decode token writes them (into the
    ring too)."""
    from kvchat.kernels import quant, triton_kv

    out = []
    for name, bits, center, clip in (("fp16", 16, False, False), ("int8 K", 8, True, False), ("int8 V", 8, False, False),
                                     ("fp8 K", 8, True, False), ("fp8 V", 8, False, False),
                                     ("int4 V", 4, False, False)):
        fp8 = name.startswith("fp8")
        data = {16: dtype, 8: "u8" if fp8 else "i8", 4: "u8"}[bits]
        sig = {"x_ptr": _ptr(dtype), "slot_ptr": "*i64", "center_ptr": "*fp32", "cscale_ptr": "*fp32",
               "rot_ptr": "*fp32", "data_ptr": _ptr(data), "scale_ptr": "*u8" if fp8 else "*fp16",
               "ring_ptr": _ptr(dtype), "wmeta_ptr": "*i32", "n": "i32", "x_stride_t": "i32", "x_stride_h": "i32"}
        consts = dict(KV_HEADS=kv_heads, D=head_dim, BITS=bits, HAS_CENTER=center, GROUP=quant.GROUP, CLIP=clip,
                      RING=bits < 16, BLOCK_T=triton_kv.WRITE_TILE, BLOCK_K=triton_kv.WRITE_K, FP8=fp8)
        sig.update({k: "constexpr" for k in consts})
        out.append(Variant(f"write {name}", "_quantize_write_kernel", sig, consts, 4,
                           [k for k, v in sig.items() if v.startswith("*")]))
    return out


def dequantize_variants(kv_heads: int, head_dim: int, dtype: str = "bf16") -> list[Variant]:
    """``dequantize_rows`` into the model's dtype, for int8, fp8 and int4 halves (a prefill's context)."""
    from kvchat.kernels import quant, triton_kv

    out = []
    for name, bits in (("int8", 8), ("fp8", 8), ("int4", 4)):
        fp8 = name == "fp8"
        sig = {"data_ptr": "*i8" if name == "int8" else "*u8", "scale_ptr": "*u8" if fp8 else "*fp16",
               "table_ptr": "*i32", "out_ptr": _ptr(dtype), "first": "i32", "n": "i32", "out_stride_t": "i32",
               "out_stride_h": "i32"}
        consts = dict(KV_HEADS=kv_heads, D=head_dim, BS=16, BITS=bits, GROUP=quant.GROUP,
                      ROWS=triton_kv.dequantize_rows_per_program(head_dim), BF16=dtype == "bf16")
        sig.update({k: "constexpr" for k in consts})
        sig["FP8"] = "constexpr"
        out.append(Variant(f"dequantize {name}", "_dequantize_rows_kernel", sig, consts, 4,
                           [k for k, v in sig.items() if v.startswith("*")], fp8))
    return out


def variant_class(kernel: str, consts: dict, fp8: bool) -> tuple:
    """What makes a launch another variant of the engine's kernels, whatever the shape or dtype:
    the precision's bits (and fp8 or not), the window, a layer's band; for the write its centring,
    clipping and ring. The GPU's kernel step must run each class the engine runs once."""
    if kernel == "_paged_decode_kernel":
        return (kernel, consts["K_BITS"], consts["V_BITS"], fp8, bool(consts["WINDOW"]),
                bool(consts["SLIDE"] or consts["CAP"]))
    if kernel == "_quantize_write_kernel":
        return kernel, consts["BITS"], bool(consts["HAS_CENTER"]), bool(consts["CLIP"]), bool(consts["RING"]), fp8
    if kernel == "_dequantize_rows_kernel":
        return kernel, consts["BITS"], fp8
    if kernel == "_block_keys_kernel":
        return kernel, bool(consts["RING"])
    return (kernel,)


def block_key_variants(kv_heads: int, head_dim: int, dtype: str = "bf16") -> list[Variant]:
    """int4's keys (``triton_int4``): the write of a prefill chunk and of a decode token (its
    block's earlier rows from the window's ring), and the read of a prefill's past."""
    out = []
    for ring in (False, True):
        sig = {"x_ptr": "*fp32", "slot_ptr": "*i64", "ring_ptr": _ptr(dtype), "wmeta_ptr": "*i32", "data_ptr": "*u8",
               "code_ptr": "*u8", "zero_ptr": "*fp16", "steps_ptr": "*fp32", "n": "i32", "x_stride_t": "i32",
               "x_stride_h": "i32"}
        consts = dict(KV_HEADS=kv_heads, D=head_dim, BS=16, RING=ring, W_SINKS=SINKS if ring else 0,
                      W_SIZE=WINDOW if ring else 1)
        sig.update({k: "constexpr" for k in consts})
        out.append(Variant(f"write int4 K blocks{' +ring' if ring else ''}", "_block_keys_kernel", sig, consts, 4,
                           [k for k, v in sig.items() if v.startswith("*")]))
    sig = {"data_ptr": "*u8", "code_ptr": "*u8", "zero_ptr": "*fp16", "steps_ptr": "*fp32", "table_ptr": "*i32",
           "out_ptr": _ptr(dtype), "first": "i32", "n": "i32", "out_stride_t": "i32", "out_stride_h": "i32"}
    consts = dict(KV_HEADS=kv_heads, D=head_dim, BS=16, BF16=dtype == "bf16")
    sig.update({k: "constexpr" for k in consts})
    out.append(Variant("dequantize int4 K blocks", "_dequantize_kernel", sig, consts, 4,
                       [k for k, v in sig.items() if v.startswith("*")]))
    return out


def all_variants(heads: int, kv_heads: int, head_dim: int) -> list[Variant]:
    return (decode_variants(heads, kv_heads, head_dim) + write_variants(kv_heads, head_dim)
            + dequantize_variants(kv_heads, head_dim) + block_key_variants(kv_heads, head_dim))


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(cubin: bytes) -> dict:
    """Registers, stack (spills land there) and local memory of the cubin's kernel, from
    ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                              check=True).stdout
    return parse_resources(text)


def parse_resources(text: str) -> dict:
    got = {key.lower(): int(value) for key, value in re.findall(r"\b(REG|STACK|LOCAL|SHARED):(\d+)", text)}
    if "reg" not in got:
        raise ValueError(f"no register count in cuobjdump's output: {text[:200]!r}")
    return {"registers": got["reg"], "stack": got.get("stack", 0), "local": got.get("local", 0)}


def compile_variant(variant: Variant, capability: int) -> dict:
    """Compile one variant for ``sm_<capability>``: registers, spill bytes (stack + local: a spill
    is the only reason these kernels would have either), shared memory, seconds."""
    import triton
    from triton.backends.compiler import GPUTarget

    from kvchat.kernels import triton_decode, triton_int4, triton_kv

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset or 0")
    fn = next(getattr(m, variant.kernel) for m in (triton_decode, triton_kv, triton_int4) if hasattr(m, variant.kernel))
    names = list(variant.signature)
    attrs = {(names.index(p),): [["tt.divisibility", 16]] for p in variant.pointers}
    consts = variant.constexprs
    if "FP8" in variant.signature and "FP8" not in consts:  # the reads triton_kv.fp8_mode picks on this target
        consts = {**consts, "FP8": (2 if capability >= 89 else 1) if variant.fp8 else 0}
    start = time.perf_counter()
    src = triton.compiler.ASTSource(fn=fn, signature=variant.signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": variant.num_warps})
    seconds = time.perf_counter() - start
    use = resources(compiled.asm["cubin"])
    shared = compiled.metadata.shared
    threads = 32 * variant.num_warps
    by_regs = 65536 // (max(use["registers"], 1) * threads)
    by_shared = SHARED_PER_SM[capability] // shared if shared else 32
    programs = min(by_regs, by_shared, THREADS_PER_SM[capability] // threads, 32)
    return {"variant": variant.name, "target": f"sm_{capability}", "registers": use["registers"],
            "spill_bytes": use["stack"] + use["local"], "shared": shared, "programs_per_sm": programs,
            "seconds": seconds}


def judged() -> dict:
    """The Triton that compiles here, and whether its register counts are held to the budgets."""
    version = triton.__version__
    tuned = version.split(".")[:2] == TUNED_ON.split(".")
    return {"version": version, "tuned_on": TUNED_ON, "budgets": "asserted" if tuned else "reported"}


def table(shapes=SHAPES, targets=TARGETS, which=None, part: tuple[int, int] = (0, 1)) -> list[dict]:
    """Compile every variant of every shape for every target (``which(name)`` filters variants);
    ``part`` (i, n): every n-th compile from the i-th, so that n processes share the work."""
    jobs = [(label, variant, cap) for label, heads, kv_heads, head_dim in shapes
            for variant in all_variants(heads, kv_heads, head_dim) if which is None or which(variant.name)
            for cap in targets]
    i, n = part
    return [{"shape": label, **compile_variant(variant, cap)} for label, variant, cap in jobs[i::n]]

