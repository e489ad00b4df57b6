"""Triton kernels for the quantized paged KV pool (layout: quant.py). Twins of reference.py:
``quantize_write`` of ``quant.write`` and ``dequantize_rows`` of the slices
``reference.sequence_rows`` reads for a prefill chunk; the decode kernel is triton_decode.py's.

Each head_dim vector is handled as two halves of D/2, the split-half int4 layout's natural unit:
byte j of a packed row holds dim j and dim j + D/2, so one load serves both halves.
"""
import os

import torch
import triton
import triton.language as tl

from kvchat.kernels import quant
from kvchat.kernels.quant import KVFormat
from kvchat.kernels.triton_rounding import round_even, to_bf16


def unsupported(fmt: KVFormat, block_size: int, head_dim: int) -> str | None:
    """Why these kernels cannot serve a pool of this shape, or None. ``tl.arange`` spans powers of
    two only: a block, a head_dim, its halves and (quantized) the halves' groups of 32."""
    if block_size & (block_size - 1):
        return f"block size {block_size} is not a power of two"
    if head_dim & (head_dim - 1) or head_dim < 2:
        return f"head_dim {head_dim} is not a power of two"
    if fmt.quantized and head_dim < 2 * quant.GROUP:
        return f"head_dim {head_dim} is below {2 * quant.GROUP}, two groups of {quant.GROUP}, in {fmt.name}"
    if fmt.quantized and head_dim > 8 * quant.GROUP:
        return f"head_dim {head_dim} is above {8 * quant.GROUP}: a row's scales pass one 64-bit word a half"
    if head_dim < 32:
        return f"head_dim {head_dim} is below 32: the decode kernel's products need halves of 16"
    return None


def fp8_mode(fmt: KVFormat, device: torch.device) -> int:
    """How the kernels read fp8 codes: 0 not fp8; 2 as ``float8e4nv``, which sm_89 and later convert
    in hardware; 1 elsewhere (older GPUs, the interpreter) by moving the bits into an fp16 (``load_fp8``)."""
    if not fmt.float8:
        return 0
    return 2 if quant.has_fp8(device) and os.environ.get("TRITON_INTERPRET") != "1" else 1


@triton.jit
def load_fp8(ptr, offsets, mask, MODE: tl.constexpr):
    """e4m3 codes (uint8) at ``offsets`` as fp16 values, exactly (fp16 holds every e4m3 value).
    Without hardware conversion: e4m3's 4 exponent and 3 mantissa bits, shifted under fp16's
    (5 and 10), make the same number over 2^8, the two exponent biases apart (15 - 7), for
    normals and subnormals alike; the pool never holds e4m3's NaN (writes saturate)."""
    if MODE == 2:
        return tl.load(ptr.to(tl.pointer_type(tl.float8e4nv)) + offsets, mask=mask, other=0.0).to(tl.float16)
    code = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32)
    bits = ((code & 0x7F) << 7) | ((code & 0x80) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _to_fp8(y):
    """fp32 -> e4m3 codes (int32 in [0, 255]), saturating at +-448 and rounding to nearest even, as
    ``quant.to_fp8``. Normal codes are (e + 6) * 8 + round(|y| / 2^(e-3)) for |y| in [2^e, 2^(e+1)):
    the rounded mantissa runs 8..16, and 16 carries into the next exponent by itself; below 2^-6
    the code is round(|y| * 2^9), whose 8 is the smallest normal. The exponent is read from the
    bits, not from a log2 that may land one ulp under a power of two."""
    bits = y.to(tl.uint32, bitcast=True)
    a = tl.minimum(tl.abs(y), 448.0)
    e = ((a.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    down = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e), for the normals' e in -6..8
    normal = (e + 6) * 8 + round_even(a * down).to(tl.int32)
    code = tl.where(a < 0.015625, round_even(a * 512.0).to(tl.int32), normal)
    return code | ((bits >> 31) << 7).to(tl.int32)


def check_pool(tensors: dict, fmt: KVFormat, head_dim: int) -> None:
    problem = unsupported(fmt, tensors["k"].shape[1], head_dim)
    if problem:
        raise ValueError(f"the Triton KV kernels cannot take this pool: {problem} (the torch reference can)")


# One tile of WRITE_TILE tokens per program: the rotation (64 KiB at D=128) is read once per tile
# instead of once per token, and rotated with tl.dot, whose dimensions must all be >= 16 on a GPU
# (HALF >= 32 holds: quantized formats need head_dim >= 64). The sum runs over D in steps of
# WRITE_K: an fp32 dot is lowered to FMAs that hold a thread's whole K slice of both operands in
# registers (triton-lang/triton#5572). Compiled for sm_86 and sm_90 here (Triton 3.9's ptxas, no
# GPU), one D=128 slice spilled 5-8 KB a thread; slices of 32 took 72-92 registers, none spilled.
WRITE_TILE = 16
WRITE_K = 32


@triton.jit(do_not_specialize=["n"])
def _quantize_write_kernel(x_ptr, slot_ptr, center_ptr, cscale_ptr, rot_ptr, data_ptr, scale_ptr, ring_ptr, wmeta_ptr,
                           n, x_stride_t, x_stride_h, KV_HEADS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                           HAS_CENTER: tl.constexpr, GROUP: tl.constexpr, CLIP: tl.constexpr, RING: tl.constexpr,
                           BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """One program per (BLOCK_T tokens, KV head); rows past ``n`` and padding slots (-1) are
    masked out of every store. With RING (one token, row 0), its transformed row, before rounding,
    also goes to the window's ring (``engine.kv.recent_window.RecentWindow``) at the row ``wmeta[2]`` names (-1:
    none). Read from a tensor, so that a captured step can replay it."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    live = t < n
    slot = tl.load(slot_ptr + t, mask=live, other=-1).to(tl.int64)  # offsets past 2**31 in a large pool's layer
    keep = slot >= 0
    row = slot * KV_HEADS + h
    rows_ptr = x_ptr + t[:, None] * x_stride_t + h * x_stride_h
    if BITS == 16:  # the fp16 mode: stored as it is
        d = tl.arange(0, D)
        x = tl.load(rows_ptr + d[None, :], mask=keep[:, None])
        tl.store(data_ptr + row[:, None] * D + d[None, :], x.to(data_ptr.dtype.element_ty), mask=keep[:, None])
    else:
        HALF: tl.constexpr = D // 2
        j = tl.arange(0, HALF)
        lo, hi = _rotate_tile(rows_ptr, keep, center_ptr + h * D, cscale_ptr + h * D, rot_ptr, j, D, HALF,
                              HAS_CENTER, BLOCK_T, BLOCK_K)
        if RING:
            ring_row = tl.load(wmeta_ptr + 2)
            if ring_row >= 0:
                # one pointer per element of the tile, every row on the ring's row: only row 0 is stored
                ring = (ring_row * KV_HEADS + h) * D + 0 * t[:, None] + j[None, :]
                to_ring = (keep & (t == 0))[:, None]
                tl.store(ring_ptr + ring, lo.to(ring_ptr.dtype.element_ty), mask=to_ring)
                tl.store(ring_ptr + ring + HALF, hi.to(ring_ptr.dtype.element_ty), mask=to_ring)
        if FP8:
            dst = data_ptr + row[:, None] * D + j[None, :]
            tl.store(dst, _to_fp8(lo).to(tl.uint8), mask=keep[:, None])
            tl.store(dst + HALF, _to_fp8(hi).to(tl.uint8), mask=keep[:, None])
        else:
            _quantize_store(lo, hi, data_ptr, scale_ptr, row, keep, j, D, HALF, BITS, GROUP, CLIP, BLOCK_T)


@triton.jit
def _quantize_store(lo, hi, data_ptr, scale_ptr, row, keep, j, D: tl.constexpr, HALF: tl.constexpr,
                    BITS: tl.constexpr, GROUP: tl.constexpr, CLIP: tl.constexpr, BLOCK_T: tl.constexpr):
    """The int modes' codes and group scales of a tile's rotated halves, stored at ``row``."""
    q_lo, s_lo = _quantize_half(lo, BLOCK_T, HALF, BITS, GROUP, CLIP)
    q_hi, s_hi = _quantize_half(hi, BLOCK_T, HALF, BITS, GROUP, CLIP)
    G: tl.constexpr = HALF // GROUP
    g = tl.arange(0, G)
    scale_row = scale_ptr + row[:, None] * (D // GROUP) + g[None, :]
    tl.store(scale_row, s_lo, mask=keep[:, None])
    tl.store(scale_row + G, s_hi, mask=keep[:, None])
    if BITS == 8:
        dst = data_ptr + row[:, None] * D + j[None, :]
        tl.store(dst, q_lo.to(tl.int8), mask=keep[:, None])
        tl.store(dst + HALF, q_hi.to(tl.int8), mask=keep[:, None])
    else:
        packed = (q_lo.to(tl.int32) + 8) | ((q_hi.to(tl.int32) + 8) << 4)
        tl.store(data_ptr + row[:, None] * HALF + j[None, :], packed.to(tl.uint8), mask=keep[:, None])


@triton.jit
def _rotate_tile(rows_ptr, keep, center_ptr, cscale_ptr, rot_ptr, j, D: tl.constexpr, HALF: tl.constexpr,
                 HAS_CENTER: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """Rotated halves of the tile's rows, ``[BLOCK_T, HALF]`` each: ``x @ H[:, :D/2]`` and
    ``x @ H[:, D/2:]``, summed over D a BLOCK_K slice at a time. "ieee": on a GPU an fp32 dot would
    otherwise round its inputs to TF32 (10-bit mantissa), moving many values across a rounding edge."""
    lo = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)
    hi = tl.zeros([BLOCK_T, HALF], dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(rows_ptr + k[None, :], mask=keep[:, None], other=0.0).to(tl.float32)
        if HAS_CENTER:
            x = (x - tl.load(center_ptr + k)[None, :]) * tl.load(cscale_ptr + k)[None, :]
        h_rows = rot_ptr + k[:, None] * D + j[None, :]
        lo = tl.dot(x, tl.load(h_rows), lo, input_precision="ieee")
        hi = tl.dot(x, tl.load(h_rows + HALF), hi, input_precision="ieee")
    return lo, hi


@triton.jit
def _quantize_half(y, BLOCK_T: tl.constexpr, HALF: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                   CLIP: tl.constexpr):
    """``[BLOCK_T, HALF]`` rotated values -> (codes ``[BLOCK_T, HALF]``, fp16 scales ``[BLOCK_T, G]``):
    the groups of every token as the rows of one 2-D tile, then back."""
    QMAX: tl.constexpr = (1 << (BITS - 1)) - 1
    G: tl.constexpr = HALF // GROUP
    groups = tl.reshape(y, (BLOCK_T * G, GROUP))
    s = _group_scale(groups, QMAX, CLIP)
    q = tl.clamp(round_even(groups / s.to(tl.float32)[:, None]), -QMAX, QMAX)
    return tl.reshape(q, (BLOCK_T, HALF)), tl.reshape(s, (BLOCK_T, G))


@triton.jit
def _scale_error(groups, amax, ratio, QMAX: tl.constexpr):
    scale = tl.maximum(amax * ratio / QMAX, 2.0 ** -14).to(tl.float16)
    c = scale.to(tl.float32)[:, None]
    err = tl.clamp(round_even(groups / c), -QMAX, QMAX) * c - groups
    return scale, tl.sum(err * err, axis=1)


@triton.jit
def _pick(scale, best, candidate, err):
    better = err < best
    return tl.where(better, candidate, scale), tl.where(better, err, best)


@triton.jit
def _group_scale(groups, QMAX: tl.constexpr, CLIP: tl.constexpr):
    """fp16 scale per group; with CLIP, the least-squares choice among quant.CLIP_RATIOS (spelled
    out here, in the same order; a test checks the writes against the reference's)."""
    amax = tl.max(tl.abs(groups), axis=1)
    scale, best = _scale_error(groups, amax, 1.0, QMAX)
    if CLIP:
        s, e = _scale_error(groups, amax, 0.95, QMAX)
        scale, best = _pick(scale, best, s, e)
        s, e = _scale_error(groups, amax, 0.9, QMAX)
        scale, best = _pick(scale, best, s, e)
        s, e = _scale_error(groups, amax, 0.85, QMAX)
        scale, best = _pick(scale, best, s, e)
        s, e = _scale_error(groups, amax, 0.8, QMAX)
        scale, best = _pick(scale, best, s, e)
        s, e = _scale_error(groups, amax, 0.75, QMAX)
        scale, best = _pick(scale, best, s, e)
    return scale


def quantize_write(tensors: dict, fmt: KVFormat, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                   rotation: torch.Tensor, k_center: torch.Tensor | None = None,
                   k_channel_scale: torch.Tensor | None = None, ring: tuple | None = None,
                   prior: tuple | None = None) -> None:
    """Fused rotate + quantize + store through the slot mapping; padding slots (-1) are skipped in
    the kernel, so the host never waits to find them. ``ring``, ``(K rows, V rows, wmeta, sinks)``
    of a window (one token, quantized modes): its row there (``wmeta[2]``) is written in the same
    pass. int4 keys go to ``triton_int4`` rotated, after ``prior`` (``quant.write``'s), or with
    their block's earlier rows read from the ring."""
    t, kv_heads, d = key.shape
    check_pool(tensors, fmt, d)
    if fmt.block_keys:
        from kvchat.kernels import triton_int4

        k = quant.rotate(key.float(), rotation.float())
        if prior is not None:
            k, slots_k = torch.cat([prior[0].float(), k]), torch.cat([prior[1], slots])
        triton_int4.write_block_keys(tensors, k, slots if prior is None else slots_k,
                                     (ring[0], ring[2]) if ring is not None else None, ring[3] if ring else 0)
    for name, x, bits in (("k", key, fmt.k_bits), ("v", value, fmt.v_bits)):
        if name == "k" and fmt.block_keys:
            continue
        center = name == "k" and k_center is not None and bits < 16
        dummy = tensors[name]
        to_ring = ring is not None and bits < 16
        _quantize_write_kernel[(triton.cdiv(t, WRITE_TILE), kv_heads)](
            x, slots, k_center.float().contiguous() if center else dummy,
            (k_channel_scale if k_channel_scale is not None else torch.ones_like(k_center)).float().contiguous()
            if center else dummy,
            rotation.float().contiguous() if bits < 16 else dummy, tensors[name], tensors.get(name + "_scale", dummy),
            ring[0 if name == "k" else 1] if to_ring else dummy, ring[2] if to_ring else slots,
            t, x.stride(0), x.stride(1),
            KV_HEADS=kv_heads, D=d, BITS=bits, HAS_CENTER=center, GROUP=quant.GROUP,
            CLIP=name == "k" and bits == 4, RING=to_ring, BLOCK_T=WRITE_TILE,
            BLOCK_K=WRITE_K, FP8=fmt.float8)


@triton.jit
def _load_half(data_ptr, scale_ptr, row, j, HALF: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
               UPPER: tl.constexpr, GROUP: tl.constexpr, FP8: tl.constexpr):
    """One half of the rows ``row`` ``[N]`` as fp32 ``[N, D/2]``, dequantized."""
    col = j + HALF * UPPER
    if BITS == 16:
        return tl.load(data_ptr + row[:, None] * D + col[None, :]).to(tl.float32)
    if FP8:
        return load_fp8(data_ptr, row[:, None] * D + col[None, :], row[:, None] >= 0, FP8).to(tl.float32)
    s = tl.load(scale_ptr + row[:, None] * (D // GROUP) + (col // GROUP)[None, :]).to(tl.float32)
    if BITS == 8:
        q = tl.load(data_ptr + row[:, None] * D + col[None, :]).to(tl.float32)
    else:
        packed = tl.load(data_ptr + row[:, None] * HALF + j[None, :]).to(tl.int32)
        q = (((packed >> 4) if UPPER else (packed & 15)) - 8).to(tl.float32)
    return q * s


@triton.jit(do_not_specialize=["first", "n"])
def _dequantize_rows_kernel(data_ptr, scale_ptr, table_ptr, out_ptr, first, n, out_stride_t, out_stride_h,
                            KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BITS: tl.constexpr,
                            GROUP: tl.constexpr, ROWS: tl.constexpr, BF16: tl.constexpr, FP8: tl.constexpr):
    """One program per (ROWS positions, KV head): codes and scales read where the block table puts
    them, multiplied in fp32 and rounded once to out's dtype, as ``quant.read`` in fp32 then a cast."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    h = tl.program_id(1)
    live = i < n
    p = first + i
    # past n the table may end: block 0 stands in, so every load stays in the pool; the store is masked
    block_id = tl.load(table_ptr + p // BS, mask=live, other=0).to(tl.int64)
    row = (block_id * BS + p % BS) * KV_HEADS + h
    HALF: tl.constexpr = D // 2
    j = tl.arange(0, HALF)
    dst = out_ptr + i.to(tl.int64)[:, None] * out_stride_t + h * out_stride_h + j[None, :]
    lo = _load_half(data_ptr, scale_ptr, row, j, HALF, D, BITS, 0, GROUP, FP8)
    hi = _load_half(data_ptr, scale_ptr, row, j, HALF, D, BITS, 1, GROUP, FP8)
    if BF16:
        lo = to_bf16(lo)
        hi = to_bf16(hi)
    tl.store(dst, lo.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(dst + HALF, hi.to(out_ptr.dtype.element_ty), mask=live[:, None])


def dequantize_rows_per_program(head_dim: int) -> int:
    """64 positions a program up to head_dim 128; fewer above, so that a thread's share of the tile
    stays 64 fp32 values: 64 rows at head_dim 256 spilled 48 (int8) and 72 B (int4) on sm_90."""
    return min(64, 8192 // head_dim)


def dequantize_rows(tensors: dict, fmt: KVFormat, name: str, block_table: torch.Tensor, first: int, n: int,
                    out: torch.Tensor, rows: int | None = None) -> None:
    """K or V (``name``) of positions ``first .. first + n`` of one sequence into ``out``
    ``[n, kv_heads, D]`` in one pass: the prefill's past context without a gathered copy or an
    fp32 one. Still rotated, as the pool holds it; the window and fresh rows are the caller's."""
    _, bs, kv_heads, _ = tensors[name].shape
    d = out.shape[-1]
    check_pool(tensors, fmt, d)
    if n == 0:
        return
    assert out.shape[0] == n and out.stride(-1) == 1, "out: [n, kv_heads, D], each row contiguous"
    if name == "k" and fmt.block_keys:
        from kvchat.kernels import triton_int4

        return triton_int4.dequantize_block_keys(tensors, block_table, first, n, out)
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    rows = rows or dequantize_rows_per_program(d)
    _dequantize_rows_kernel[(triton.cdiv(n, rows), kv_heads)](
        tensors[name], tensors.get(name + "_scale", tensors[name]), block_table, out, first, n,
        out.stride(0), out.stride(1), KV_HEADS=kv_heads, D=d, BS=bs, BITS=bits, GROUP=quant.GROUP, ROWS=rows,
        BF16=out.dtype == torch.bfloat16, FP8=fp8_mode(fmt, out.device))
