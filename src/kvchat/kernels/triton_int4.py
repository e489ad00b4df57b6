"""Triton twins of int4.py's block keys: the write (``write_block_keys``, twin of
``int4.write_block_keys``) and the read of a prefill's past (``dequantize_block_keys``, twin of
``quant.read`` for int4 keys); the decode kernel reads them itself (triton_decode.py).

A program holds one block of one KV head, ``[BS, D/2]`` twice (the split-half packing's halves):
a block's statistics are a reduction over its rows, so its rows stay together.
"""
import torch
import triton
import triton.language as tl

from kvchat.kernels import int4
from kvchat.kernels.triton_rounding import round_even, to_bf16


@triton.jit
def _round_down_fp16(x):
    """The largest fp16 at most ``x`` (fp32), as fp32; ``int4.quantize_blocks``' minimum."""
    z = x.to(tl.float16)
    bits = z.to(tl.uint16, bitcast=True).to(tl.int32)
    down = tl.where(z > 0, bits - 1, tl.where(z < 0, bits + 1, 0x8001))  # 0: the smallest negative
    lower = down.to(tl.uint16).to(tl.float16, bitcast=True)
    return tl.where(z.to(tl.float32) > x, lower, z).to(tl.float32)


@triton.jit
def _step_code(step, steps_ptr):
    """The code of the smallest step in the table at least ``step``: log2 gives it to within one,
    the table settles it (``int4.step_code``'s searchsorted)."""
    c = tl.ceil((tl.log2(tl.maximum(step, 2.0 ** -40)) + 20.0) * 8.0)
    c = tl.minimum(tl.maximum(c, 0.0), 255.0).to(tl.int32)
    below = tl.load(steps_ptr + tl.maximum(c - 1, 0))
    c = tl.where((c > 0) & (below >= step), c - 1, c)
    at = tl.load(steps_ptr + c)
    return tl.where((at < step) & (c < 255), c + 1, c)


@triton.jit
def _store_block(lo, hi, valid, prow, srow, j, data_ptr, code_ptr, zero_ptr, steps_ptr, HALF: tl.constexpr):
    """Quantize the valid rows of a block's halves ``[BS, HALF]`` with their own statistics and store
    codes (at pool rows ``prow``) and statistics (at ``srow``)."""
    inf = float("inf")
    z_lo = _round_down_fp16(tl.min(tl.where(valid[:, None], lo, inf), axis=0))
    z_hi = _round_down_fp16(tl.min(tl.where(valid[:, None], hi, inf), axis=0))
    c_lo = _step_code((tl.max(tl.where(valid[:, None], lo, -inf), axis=0) - z_lo) / 15.0, steps_ptr)
    c_hi = _step_code((tl.max(tl.where(valid[:, None], hi, -inf), axis=0) - z_hi) / 15.0, steps_ptr)
    q_lo = tl.minimum(tl.maximum(round_even((lo - z_lo[None, :]) / tl.load(steps_ptr + c_lo)[None, :]), 0.0), 15.0)
    q_hi = tl.minimum(tl.maximum(round_even((hi - z_hi[None, :]) / tl.load(steps_ptr + c_hi)[None, :]), 0.0), 15.0)
    packed = q_lo.to(tl.int32) | (q_hi.to(tl.int32) << 4)
    tl.store(data_ptr + prow[:, None] * HALF + j[None, :], packed.to(tl.uint8), mask=valid[:, None])
    any_row = (tl.max(valid.to(tl.int32), axis=0) + 0 * j) > 0  # a vector: the interpreter takes no scalar mask
    stats = srow * (2 * HALF) + j
    tl.store(code_ptr + stats, c_lo.to(tl.uint8), mask=any_row)
    tl.store(code_ptr + stats + HALF, c_hi.to(tl.uint8), mask=any_row)
    tl.store(zero_ptr + stats, z_lo.to(tl.float16), mask=any_row)
    tl.store(zero_ptr + stats + HALF, z_hi.to(tl.float16), mask=any_row)


@triton.jit(do_not_specialize=["n"])
def _block_keys_kernel(x_ptr, slot_ptr, ring_ptr, wmeta_ptr, data_ptr, code_ptr, zero_ptr, steps_ptr,
                       n, x_stride_t, x_stride_h, KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                       RING: tl.constexpr, W_SINKS: tl.constexpr, W_SIZE: tl.constexpr):
    """One program per (block, KV head) of rotated keys ``x``. Without RING, rows ``g*BS ..`` of
    ``x`` are one block from its first row (the caller puts the earlier rows first); slot -1 rows
    are left out. With RING, one token (row 0, as a decode step writes it, captured or not): its
    block's earlier rows come from the window's ring (``wmeta``: sinks held, first position, the
    token's ring row and position) where it holds them, else from the pool as quantized so far, and
    the token's row also goes to its ring row."""
    HALF: tl.constexpr = D // 2
    i = tl.arange(0, BS)
    j = tl.arange(0, HALF)
    h = tl.program_id(1)
    if RING:
        slot = tl.load(slot_ptr).to(tl.int64)
        m = slot % BS
        block = slot // BS
        p = tl.load(wmeta_ptr + 3).to(tl.int64)
        s = tl.load(wmeta_ptr).to(tl.int64)
        first = tl.load(wmeta_ptr + 1).to(tl.int64)
        ring_row = tl.load(wmeta_ptr + 2).to(tl.int64)
        live = (slot + 0 * i) >= 0  # vectors: the interpreter's loads take no scalar in a mask
        valid = (i <= m) & live
        earlier = (i < m) & live
        prow = ((block * BS + i) * KV_HEADS + h).to(tl.int64)
        srow = block * KV_HEADS + h
        new_lo = tl.load(x_ptr + h * x_stride_h + j).to(tl.float32)
        new_hi = tl.load(x_ptr + h * x_stride_h + HALF + j).to(tl.float32)
        if ring_row >= 0:
            dst = ring_ptr + (ring_row * KV_HEADS + h) * D + j
            kept = (slot + 0 * j) >= 0
            tl.store(dst, new_lo.to(ring_ptr.dtype.element_ty), mask=kept)
            tl.store(dst + HALF, new_hi.to(ring_ptr.dtype.element_ty), mask=kept)
        if first <= tl.maximum(p - m, s):  # the window holds the earlier rows: exact
            pos = p - m + i
            wrow = tl.where(pos < s, pos, W_SINKS + pos % W_SIZE)
            src = ring_ptr + (wrow * KV_HEADS + h)[:, None] * D + j[None, :]
            lo = tl.load(src, mask=earlier[:, None], other=0.0).to(tl.float32)
            hi = tl.load(src + HALF, mask=earlier[:, None], other=0.0).to(tl.float32)
        else:
            srow_safe = tl.where(slot >= 0, srow, 0)
            srows = srow_safe + 0 * i
            lo = _pool_rows(data_ptr, code_ptr, zero_ptr, steps_ptr, prow, srows, j, earlier, HALF, 0)
            hi = _pool_rows(data_ptr, code_ptr, zero_ptr, steps_ptr, prow, srows, j, earlier, HALF, 1)
        lo = tl.where((i == m)[:, None], new_lo[None, :], lo)
        hi = tl.where((i == m)[:, None], new_hi[None, :], hi)
    else:
        t = tl.program_id(0) * BS + i
        slots = tl.load(slot_ptr + t, mask=t < n, other=-1).to(tl.int64)
        valid = slots >= 0
        block = tl.max(tl.where(valid, slots // BS, -1), axis=0)
        prow = slots * KV_HEADS + h
        srow = tl.maximum(block, 0) * KV_HEADS + h
        src = x_ptr + t[:, None] * x_stride_t + h * x_stride_h + j[None, :]
        lo = tl.load(src, mask=valid[:, None], other=0.0).to(tl.float32)
        hi = tl.load(src + HALF, mask=valid[:, None], other=0.0).to(tl.float32)
    _store_block(lo, hi, valid, prow, srow, j, data_ptr, code_ptr, zero_ptr, steps_ptr, HALF)


def write_block_keys(tensors: dict, keys: torch.Tensor, slots: torch.Tensor, ring: tuple | None = None,
                     sinks: int = 0) -> None:
    """Rotated keys ``[T, kv_heads, D]`` into an int4 pool. Without ``ring``: every block from its
    first row (``quant.write``'s ``prior`` put first). With ``ring``, ``(window K rows, wmeta)``
    (``dispatch.window_meta``) of a window with ``sinks`` sink rows: one decode token."""
    t, kv_heads, d = keys.shape
    bs = tensors["k"].shape[1]
    steps = int4.steps(keys.device)
    dummy = tensors["k"]
    ring_rows = ring[0] if ring is not None else dummy
    size = ring_rows.shape[0] - sinks if ring is not None else 1
    grid = (1 if ring is not None else triton.cdiv(t, bs), kv_heads)
    _block_keys_kernel[grid](keys, slots, ring_rows, ring[1] if ring is not None else slots, tensors["k"],
                             tensors["k_scale"],
                             tensors["k_zero"], steps, t, keys.stride(0), keys.stride(1), KV_HEADS=kv_heads, D=d,
                             BS=bs, RING=ring is not None, W_SINKS=sinks, W_SIZE=max(size, 1))


@triton.jit(do_not_specialize=["first", "n"])
def _dequantize_kernel(data_ptr, code_ptr, zero_ptr, steps_ptr, table_ptr, out_ptr, first, n, out_stride_t,
                       out_stride_h, KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BF16: tl.constexpr):
    """One program per (BS positions, KV head), each row read with its own block's statistics."""
    HALF: tl.constexpr = D // 2
    i = tl.program_id(0) * BS + tl.arange(0, BS)  # output rows
    h = tl.program_id(1)
    live = i < n
    pos = first + i
    block = tl.load(table_ptr + pos // BS, mask=live, other=0).to(tl.int64)
    j = tl.arange(0, HALF)
    prow = (block * BS + pos % BS) * KV_HEADS + h
    srow = block * KV_HEADS + h
    lo = _pool_rows(data_ptr, code_ptr, zero_ptr, steps_ptr, prow, srow, j, live, HALF, 0)
    hi = _pool_rows(data_ptr, code_ptr, zero_ptr, steps_ptr, prow, srow, j, live, HALF, 1)
    if BF16:
        lo = to_bf16(lo)
        hi = to_bf16(hi)
    dst = out_ptr + i.to(tl.int64)[:, None] * out_stride_t + h * out_stride_h + j[None, :]
    tl.store(dst, lo.to(out_ptr.dtype.element_ty), mask=live[:, None])
    tl.store(dst + HALF, hi.to(out_ptr.dtype.element_ty), mask=live[:, None])


@triton.jit
def _pool_rows(data_ptr, code_ptr, zero_ptr, steps_ptr, prow, srow, j, live, HALF: tl.constexpr, UPPER: tl.constexpr):
    """One half of pool rows ``prow`` ``[N]``, each dequantized with its block's statistics (row
    ``srow`` ``[N]`` of ``k_scale``/``k_zero``)."""
    packed = tl.load(data_ptr + prow[:, None] * HALF + j[None, :], mask=live[:, None], other=0x88).to(tl.int32)
    q = ((packed >> 4) if UPPER else (packed & 15)).to(tl.float32)
    col = srow[:, None] * (2 * HALF) + (j + HALF * UPPER)[None, :]
    step = tl.load(steps_ptr + tl.load(code_ptr + col, mask=live[:, None], other=0).to(tl.int32))
    return q * step + tl.load(zero_ptr + col, mask=live[:, None], other=0.0).to(tl.float32)


def dequantize_block_keys(tensors: dict, block_table: torch.Tensor, first: int, n: int, out: torch.Tensor) -> None:
    """Keys of positions ``first .. first + n`` of one sequence into ``out`` ``[n, kv_heads, D]``
    (``triton_kv.dequantize_rows`` for int4 keys)."""
    _, bs, kv_heads, _ = tensors["k"].shape
    if n == 0:
        return
    _dequantize_kernel[(triton.cdiv(n, bs), kv_heads)](
        tensors["k"], tensors["k_scale"], tensors["k_zero"], int4.steps(out.device), block_table, out, first, n,
        out.stride(0), out.stride(1), KV_HEADS=kv_heads, D=out.shape[-1], BS=bs, BF16=out.dtype == torch.bfloat16)
