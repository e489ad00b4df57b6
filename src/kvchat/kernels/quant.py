"""The quantized KV layout, written down once: this file is its executable spec.

- Groups of ``GROUP`` = 32 values along head_dim share one fp16 scale; quantization is symmetric
  (no zero point), so int8 uses [-127, 127] and int4 [-7, 7].
- int4 is packed two values a byte, split-half: byte j holds dim j in its low nibble and dim
  j + D/2 in its high nibble, each stored as value + 8.
- In the quantized modes K and V are rotated before quantizing by the normalized Walsh-Hadamard
  matrix H (symmetric, H @ H = I) over head_dim. Rotation spreads outlier channels over the group, so
  one scale fits all 32 values. Attention stays exact in exact arithmetic: the query is rotated the
  same way (q H . k H = q . k) and the output, a mix of rotated values, is rotated back by H.
- Before rotating, K is centred: a fixed per-layer, per-head vector (the mean key of a calibration
  text) is subtracted. Keys share a large common component (post-RoPE, in the slowly rotating
  dimensions); removing it halves what the 4 bits must span. Attention is unchanged, since
  q . (k - c) differs from q . k by q . c, the same for every key of a query, and softmax ignores it.
- Then each key channel is multiplied by a fixed scale s (and each query divided by it, which keeps
  q . k exact), to spend the bits where the queries look. Centre and scale come from calibration.
- int4 keys (``KVFormat.block_keys``) take none of that: rotated only, they are quantized per
  channel over each block's tokens, with the block's own statistics (``int4.py``). A block's
  statistics change while it fills, so each write quantizes the block again from its first row
  (``write``'s ``prior``: the earlier rows, from the full-precision window); they are final once
  the block is full.
- Each live sequence also keeps its first ``SINKS`` and its newest ``WINDOW`` tokens in full
  precision, outside the pool (``RecentWindow``), already centred, scaled and rotated; attention reads
  those rows from there instead of their quantized copies. The pool's blocks are the same with or
  without it. Measured on the starter (int4, GPL-3, context 512): +3.2% -> +1.1% (newest 64).
- fp8 (e4m3) stores the same transformed K and V as codes with no per-token scale: 1 byte a value,
  half of fp16. A scale per layer and KV head, a power of two from calibration, maps the largest
  value to about an eighth of e4m3's range; the pool's owner folds it in (the key's into its channel scale, the
  value's divided before the write and multiplied back into the output), so the kernels only cast,
  saturating at +-448.
- Per layer the pool holds, with one leading block index: ``k``, ``v`` (data) and, in the int modes,
  ``k_scale``, ``v_scale`` of shape ``[blocks, block_size, kv_heads, D / 32]``; int4's keys
  ``k_scale`` (step codes) and ``k_zero`` of shape ``[blocks, kv_heads, D]`` instead.
"""
import functools
import math

import torch

from kvchat.kernels import int4
from kvchat.kernels.int4 import dequantize_blocks, pack_int4, unpack_int4  # noqa: F401 (read through here)
# the sizes, torch-free, live in core/kv_format.py; FORMATS and token_bytes are read through here too
from kvchat.core.kv_format import (FORMATS, FP8_MAX, GROUP, SINKS, WINDOW, KVFormat, qmax,  # noqa: F401
                                   token_bytes, window_bytes)

SCALE_DTYPE = torch.float16
FP8_DTYPE = torch.float8_e4m3fn
_MIN_SCALE = 2.0 ** -14  # the smallest normal fp16
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75)


@functools.cache
def has_fp8(device: torch.device) -> bool:
    """The device converts fp8 in hardware (CUDA sm_89 and later): the kernels read fp8 codes as
    such there. Asked per kernel launch, so answered once per device."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def hadamard(d: int, device=None, dtype=torch.float32) -> torch.Tensor:
    if d & (d - 1):
        raise ValueError(f"head_dim {d} is not a power of two: no Walsh-Hadamard rotation")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(d)).to(device=device, dtype=dtype)


def quantize(x: torch.Tensor, bits: int, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., D]`` float -> (data, fp16 scales ``[..., D/32]``)."""
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1)
    scale, best = (amax / qmax(bits)).clamp(min=_MIN_SCALE).to(SCALE_DTYPE), None
    for ratio in CLIP_RATIOS if clip else ():
        candidate = (amax * ratio / qmax(bits)).clamp(min=_MIN_SCALE).to(SCALE_DTYPE)
        c = candidate.float().unsqueeze(-1)
        err = ((torch.round(groups / c).clamp(-qmax(bits), qmax(bits)) * c - groups) ** 2).sum(-1)
        if best is None:
            scale, best = candidate, err
        else:
            scale, best = torch.where(err < best, candidate, scale), torch.minimum(err, best)
    q = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-qmax(bits), qmax(bits)).flatten(-2)
    data = q.to(torch.int8) if bits == 8 else pack_int4(q)
    return data, scale


def to_fp8(x: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as the pool keeps them, uint8 (the CPU has no index_copy or index_select for
    float8 tensors), saturating: a cast alone turns what lies past +-448 into NaN."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)


def from_fp8(codes: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return codes.view(FP8_DTYPE).to(dtype)


def fp8_order(codes: torch.Tensor) -> torch.Tensor:
    """e4m3 codes (sign and magnitude) as signed integers in value order: one step is one code."""
    return (codes.int() & 0x7F) * (1 - 2 * (codes.int() >> 7))


def dequantize(data: torch.Tensor, scale: torch.Tensor, bits: int, dtype=torch.float32) -> torch.Tensor:
    q = data if bits == 8 else unpack_int4(data)
    groups = q.to(dtype).unflatten(-1, (-1, GROUP)) * scale.to(dtype).unsqueeze(-1)
    return groups.flatten(-2)


def layer_tensors(fmt: KVFormat, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device) -> dict[str, torch.Tensor]:
    """One layer's share of the pool, every tensor indexed by block id first. Plain tensors even
    when made in inference mode (a conversion): the compiled decode step's guards tell the two apart."""
    with torch.inference_mode(False):
        return _layer_tensors(fmt, num_blocks, block_size, kv_heads, head_dim, dtype, device)


def _layer_tensors(fmt, num_blocks, block_size, kv_heads, head_dim, dtype, device) -> dict[str, torch.Tensor]:
    out = {}
    for name, bits in (("k", fmt.k_bits), ("v", fmt.v_bits)):
        lead = (num_blocks, block_size, kv_heads)
        if bits == 16:
            out[name] = torch.zeros(*lead, head_dim, dtype=dtype, device=device)
        elif fmt.float8:
            out[name] = torch.zeros(*lead, head_dim, dtype=torch.uint8, device=device)  # e4m3 bits
        else:
            width = head_dim if bits == 8 else head_dim // 2
            out[name] = torch.zeros(*lead, width, dtype=torch.int8 if bits == 8 else torch.uint8, device=device)
            if name == "k" and fmt.block_keys:
                out["k_scale"] = torch.zeros(num_blocks, kv_heads, head_dim, dtype=torch.uint8, device=device)
                out["k_zero"] = torch.zeros(num_blocks, kv_heads, head_dim, dtype=int4.ZERO_DTYPE, device=device)
            else:
                out[name + "_scale"] = torch.zeros(*lead, head_dim // GROUP, dtype=SCALE_DTYPE, device=device)
    return out


def write(tensors: dict, fmt: KVFormat, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
          rotation: torch.Tensor | None, k_center: torch.Tensor | None = None,
          k_channel_scale: torch.Tensor | None = None, keep_rows=None, prior: tuple | None = None) -> None:
    """Quantize on write: ``key``/``value`` ``[T, kv_heads, D]`` go to ``slots``; -1 is skipped.
    ``k_center`` ``[kv_heads, D]`` is subtracted from quantized keys, then ``k_channel_scale``
    multiplies them. ``keep_rows(k, v)``, when given, receives the transformed rows before they are
    quantized (the full-precision window; it expects no padding). With ``block_keys``, every block
    written must be given from its first row: ``prior``, ``(K rows transformed, their slots)``,
    holds the rows of the first block that precede ``key``."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    if fmt.block_keys:  # rotated only: their statistics are the block's own
        k_center = k_channel_scale = None
    k = transform_keys(key.float(), rotation, k_center, k_channel_scale) if fmt.k_bits < 16 else key
    v = rotate(value.float(), rotation) if fmt.v_bits < 16 else value
    if keep_rows is not None:
        keep_rows(k, v)
    for name, x, bits in (("k", k, fmt.k_bits), ("v", v, fmt.v_bits)):
        if bits == 16:
            _store(tensors[name], slots, x)
            continue
        if fmt.float8:
            _store(tensors[name], slots, to_fp8(x))
            continue
        if name == "k" and fmt.block_keys:
            int4.write_block_keys(tensors, x, slots, prior)
            continue
        data, scale = quantize(x, bits, clip=name == "k" and bits == 4)
        _store(tensors[name], slots, data)
        _store(tensors[name + "_scale"], slots, scale)


def read_slots(tensors: dict, fmt: KVFormat, name: str, slots: torch.Tensor) -> torch.Tensor:
    """K or V at ``slots``, dequantized (still transformed), fp32: ``[len(slots), kv_heads, D]``."""
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    data = tensors[name].flatten(0, 1).index_select(0, slots)
    if bits == 16:
        return data.float()
    if fmt.float8:
        return from_fp8(data)
    if name == "k" and fmt.block_keys:
        block = slots.div(tensors["k"].shape[1], rounding_mode="floor")
        return dequantize_blocks(data, tensors["k_scale"].index_select(0, block), tensors["k_zero"].index_select(0, block))
    return dequantize(data, tensors[name + "_scale"].flatten(0, 1).index_select(0, slots), bits)


def rotate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight`` over the last dim; for a decode step's few rows, as a broadcast product and a
    sum, which stay on one thread: a tiny matmul wakes the whole CPU thread pool, and on a busy
    2-core machine that costs more than the product itself."""
    if x[..., 0].numel() * weight.shape[-1] * weight.shape[-2] > 65536:
        return x @ weight
    return (x.unsqueeze(-1) * weight).sum(-2)


def transform_keys(k: torch.Tensor, rotation, center=None, channel_scale=None) -> torch.Tensor:
    """``((k - center) * channel_scale) @ rotation`` for ``k`` ``[T, kv_heads, D]``."""
    if center is not None:
        k = k - center
    if channel_scale is not None:
        k = k * channel_scale
    return rotate(k, rotation)


def transform_queries(q: torch.Tensor, rotation, channel_scale=None) -> torch.Tensor:
    """``(q / channel_scale) @ rotation`` for ``q`` ``[T, heads, D]``, each query head divided by its
    KV head's scale (GQA: heads are grouped by KV head, consecutive)."""
    if channel_scale is not None:
        t, heads, d = q.shape
        q = (q.view(t, channel_scale.shape[0], -1, d) / channel_scale[:, None, :].to(q.dtype)).view(t, heads, d)
    return rotate(q, rotation)


def _store(pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    pool.view(-1, *pool.shape[2:]).index_copy_(0, slots, x.to(pool.dtype))


def gather_blocks(t: torch.Tensor, block_table: torch.Tensor, first_block: int | None) -> torch.Tensor:
    """A per-block tensor's rows of a sequence's blocks, ``[blocks, ...]``."""
    return t[first_block:first_block + len(block_table)] if first_block is not None else t.index_select(0, block_table)


def gather(pool: torch.Tensor, block_table: torch.Tensor, length: int, first_block: int | None) -> torch.Tensor:
    return gather_blocks(pool, block_table, first_block).flatten(0, 1)[:length]


def read(tensors: dict, fmt: KVFormat, name: str, block_table, length: int, first_block, dtype) -> torch.Tensor:
    """One sequence's K or V, dequantized (still rotated): ``[length, kv_heads, D]``."""
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    if name == "k" and fmt.block_keys:  # whole blocks, each under its statistics broadcast (not a copy per row)
        codes = unpack_int4(gather_blocks(tensors["k"], block_table, first_block)).float() + 8
        step = int4.step_of(gather_blocks(tensors["k_scale"], block_table, first_block))[:, None]
        zero = gather_blocks(tensors["k_zero"], block_table, first_block).float()[:, None]
        return (codes * step + zero).flatten(0, 1)[:length].to(dtype)
    data = gather(tensors[name], block_table, length, first_block)
    if bits == 16:
        return data
    if fmt.float8:
        return from_fp8(data, dtype)
    return dequantize(data, gather(tensors[name + "_scale"], block_table, length, first_block), bits, dtype)


def substitute(x: torch.Tensor, s: int, first: int, rows: torch.Tensor) -> torch.Tensor:
    """A dequantized sequence ``x`` (a fresh tensor) with positions ``0 .. s`` and ``first ..``
    replaced by ``rows``, as ``RecentWindow.rows`` gives them."""
    x[:s] = rows[:s].to(x.dtype)
    x[first:first + rows.shape[0] - s] = rows[s:].to(x.dtype)
    return x
