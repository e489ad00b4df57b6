"""Pure-torch paged KV ops: the executable spec of the pool, and the CPU path.

A token at position ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size
+ p % block_size``; slot ``-1`` is padding and is never written. The per-layer tensors and the
quantized layout are defined in ``quant.py``.
"""
import torch
import torch.nn.functional as F

from . import quant
from .quant import KVFormat

write_kv = quant.write


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` is a run ``b, b+1, ...`` (then K/V are read as a view, not
    copied), else None."""
    first = block_ids[0]
    return first if all(b == first + i for i, b in enumerate(block_ids)) else None


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Query i (at position kv_len - q_len + i) sees keys 0..its own position."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


def paged_attention(query: torch.Tensor, tensors: dict, fmt: KVFormat, block_table: torch.Tensor,
                    context_len: int, scale: float, first_block: int | None = None,
                    rotation: torch.Tensor | None = None, k_channel_scale: torch.Tensor | None = None,
                    window: tuple | None = None, fresh: tuple | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, D]``, the last T tokens of a sequence of
    ``context_len`` tokens whose K/V are already in the pool. ``window``, from
    ``quant.RecentWindow.rows``, replaces the quantized rows it holds. ``fresh``, the query tokens'
    own K/V as ``quant.write`` transformed them (before rounding), serves those T positions: a
    prefill chunk then attends to itself exactly and reads only the earlier context quantized, as
    vLLM's chunked prefill does. Returns ``[T, heads, D]``."""
    q_len, dtype = query.shape[0], query.dtype
    # Dequantize and rotate in fp32: in bf16, H @ H is 0.9998 I at D=128 and int8's error grows 9%.
    work = torch.float32 if fmt.quantized else dtype
    past = context_len - q_len if fresh is not None else context_len
    k = quant.read(tensors, fmt, "k", block_table, past, first_block, work)
    v = quant.read(tensors, fmt, "v", block_table, past, first_block, work)
    if fresh is not None:
        k, v = torch.cat([k, fresh[0].to(work)]), torch.cat([v, fresh[1].to(work)])
    if window is not None:
        s, first, wk, wv = window
        k = quant.substitute(k, s, first, wk) if fmt.k_bits < 16 else k
        v = quant.substitute(v, s, first, wv) if fmt.v_bits < 16 else v
    q = query
    if fmt.k_bits < 16:
        q = quant.transform_queries(query.float(), rotation.float(), k_channel_scale)
    q, k, v = (t.to(dtype).transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    out = causal_attention(q, k, v, scale)[0].transpose(0, 1)
    return quant.rotate(out.float(), rotation.float()).to(dtype) if fmt.v_bits < 16 else out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     expand_groups: bool | None = None) -> torch.Tensor:
    """SDPA for ``q`` ``[1, H, T, D]``, the last T of the ``S`` positions of ``k``/``v``
    ``[1, Hkv, S, D]``, called so that a fused kernel takes it: the math kernel would build the
    ``[H, T, S]`` scores in fp32 (5 GiB for an 8B model's 512-token chunk at 32k context).
    A chunk that starts the sequence is plain causal. Later chunks need a mask, and no fused CUDA
    kernel takes a mask with grouped K/V heads, so there K/V are expanded to the query heads
    (``expand_groups``, CUDA by default); the CPU's fused kernel takes both."""
    q_len, kv_len, groups = q.shape[2], k.shape[2], q.shape[1] != k.shape[1]
    if q_len == 1 or q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scale, enable_gqa=groups)
    if groups and (q.is_cuda if expand_groups is None else expand_groups):
        n = q.shape[1] // k.shape[1]
        k, v, groups = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(q_len, kv_len, q.device), scale=scale,
                                          enable_gqa=groups)
