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
                    window: tuple | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, D]``, the last T tokens of a sequence of
    ``context_len`` tokens whose K/V are already in the pool. ``window``, from
    ``quant.RecentWindow.rows``, replaces the quantized rows it holds. Returns ``[T, heads, D]``."""
    q_len, dtype = query.shape[0], query.dtype
    k = quant.read(tensors, fmt, "k", block_table, context_len, first_block, dtype)
    v = quant.read(tensors, fmt, "v", block_table, context_len, first_block, dtype)
    if window is not None:
        s, first, wk, wv = window
        k = quant.substitute(k, s, first, wk) if fmt.k_bits < 16 else k
        v = quant.substitute(v, s, first, wv) if fmt.v_bits < 16 else v
    q = quant.transform_queries(query, rotation.to(dtype), k_channel_scale) if fmt.k_bits < 16 else query
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask = None if q_len == 1 else causal_mask(q_len, context_len, query.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out = out[0].transpose(0, 1)
    return quant.rotate(out, rotation.to(dtype)) if fmt.v_bits < 16 else out
