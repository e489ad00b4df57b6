"""4-bit codes: two a byte, and int4 keys quantized per channel over each block's tokens.

- Packing is split-half: byte j holds dim j in its low nibble and dim j + D/2 in its high nibble,
  each stored as value + 8.
- Keys (``KVFormat.block_keys``), once rotated, are quantized per block, KV head and channel: codes
  0..15 from the block's minimum (``k_zero``, fp16, rounded down) in steps ``exp2(code / 8 - 20)``
  (``k_scale``, one byte, rounded up), so the 16 codes span the channel's range in that block:
  KIVI's grouping (Liu et al., 2024), statistics from the block itself. Key outliers sit in fixed
  channels, which a per-channel step absorbs; a statistic taken from the block fits any text, where
  calibrated ones fit the calibration text (docs/performance.md has the figures).
"""
import functools
import math

import torch

ZERO_DTYPE = torch.float16
STEP_CODES, STEP_BIAS = 8, 20  # a step code c means exp2(c / 8 - 20): 2^-20 .. 2^11.9, 9 % apart


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Signed values in [-8, 7], ``[..., D]`` -> ``[..., D/2]`` uint8, split-half."""
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    half = u.shape[-1] // 2
    return u[..., :half] | (u[..., half:] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.cat([low, high], dim=-1)


@functools.cache
def steps(device) -> torch.Tensor:
    """Every step a code can name, fp32 ``[256]``: the same table in the kernels, so a code means
    the same step on every device (no exp2 or log2 whose last bit differs between them)."""
    table = 2.0 ** (torch.arange(256, dtype=torch.float64) / STEP_CODES - STEP_BIAS)
    return table.to(device=device, dtype=torch.float32)


def step_code(step: torch.Tensor) -> torch.Tensor:
    """The code of the smallest step at least ``step``."""
    code = torch.searchsorted(steps(step.device), step.float().contiguous())
    return code.clamp(max=255).to(torch.uint8)


def step_of(code: torch.Tensor) -> torch.Tensor:
    return steps(code.device)[code.long()]


def quantize_blocks(x: torch.Tensor, block: torch.Tensor, blocks: int) -> tuple:
    """``x`` ``[T, kv_heads, D]`` in ``blocks`` groups (``block`` ``[T]``, 0 .. blocks-1) -> 4-bit
    codes ``[T, kv_heads, D/2]`` and each group's step codes and minimums ``[blocks, kv_heads, D]``:
    per channel, ``x = code * step + minimum`` with codes 0..15."""
    x = x.float()
    if blocks == 1:  # a decode step's write: one block, plain reductions
        lo, hi = x.amin(0, keepdim=True), x.amax(0, keepdim=True)
    else:
        index = block[:, None, None].expand_as(x)
        lo = x.new_full((blocks, *x.shape[1:]), math.inf).scatter_reduce(0, index, x, "amin")
        hi = x.new_full((blocks, *x.shape[1:]), -math.inf).scatter_reduce(0, index, x, "amax")
    zero = lo.to(ZERO_DTYPE)  # rounded down, so that the 16 codes still reach the minimum
    zero = torch.where(zero.float() > lo, torch.nextafter(zero, torch.full_like(zero, -math.inf)), zero)
    code = step_code((hi - zero.float()) / 15)
    per_row = (lambda t: t) if blocks == 1 else (lambda t: t[block])  # one block broadcasts
    q = x - per_row(zero.float())  # in place from here: a rebuild converts thousands of rows at once
    q = q.div_(per_row(step_of(code))).round_().clamp_(0, 15).sub_(8)
    return pack_int4(q), code, zero


def dequantize_blocks(data: torch.Tensor, code: torch.Tensor, zero: torch.Tensor, dtype=torch.float32):
    """``quantize_blocks``' codes back, with each row's block statistics ``code``/``zero`` ``[T, kv_heads, D]``."""
    return ((unpack_int4(data).float() + 8) * step_of(code) + zero.float()).to(dtype)


def write_block_keys(tensors: dict, k: torch.Tensor, slots: torch.Tensor, prior: tuple | None) -> None:
    """Rotated keys ``k`` to ``slots`` (no padding), each block they touch quantized again from its
    first row: ``prior``, ``(rows, slots)``, holds the first block's rows before ``k``."""
    if prior is not None:
        k, slots = torch.cat([prior[0].float(), k]), torch.cat([prior[1], slots])
    bs = tensors["k"].shape[1]
    blocks = slots.div(bs, rounding_mode="floor")
    if int(blocks[0]) == int(blocks[-1]):  # one block (a decode step's): no sort
        ids, block = blocks[:1], torch.zeros_like(blocks)
    else:
        ids, block = torch.unique(blocks, return_inverse=True)
    data, code, zero = quantize_blocks(k, block, len(ids))
    tensors["k"].view(-1, *tensors["k"].shape[2:]).index_copy_(0, slots, data)
    tensors["k_scale"].index_copy_(0, ids, code)
    tensors["k_zero"].index_copy_(0, ids, zero)
