"""Pure-torch paged KV ops: the executable spec of the pool layout, and the CPU path.

Layout, per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads, head_dim]``.
A token at position ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size
+ p % block_size``; slot ``-1`` is padding and is never written.
"""
import torch
import torch.nn.functional as F


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Store ``key``/``value`` ``[T, kv_heads, head_dim]`` at ``slots`` ``[T]``."""
    keep = slots >= 0
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int,
              first_block: int | None = None) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, kv_heads, head_dim]``. When the
    caller knows the table is one run of consecutive ids starting at ``first_block``, this is a
    view, not a copy."""
    if first_block is not None:
        return cache[first_block:first_block + len(block_table)].flatten(0, 1)[:length]
    return cache.index_select(0, block_table).flatten(0, 1)[:length]


def consecutive_start(block_ids: list[int]) -> int | None:
    """The first id when ``block_ids`` is a run ``b, b+1, ...``, else None."""
    first = block_ids[0]
    return first if all(b == first + i for i, b in enumerate(block_ids)) else None


def causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """Query i (at position kv_len - q_len + i) sees keys 0..its own position."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    return torch.arange(kv_len, device=device)[None, :] <= q_pos


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_table: torch.Tensor, context_len: int, scale: float,
                    first_block: int | None = None) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, head_dim]``, the last T tokens of a sequence of
    ``context_len`` tokens whose K/V are already in the pool. Returns ``[T, heads, head_dim]``."""
    q_len = query.shape[0]
    k = gather_kv(k_cache, block_table, context_len, first_block).transpose(0, 1).unsqueeze(0)
    v = gather_kv(v_cache, block_table, context_len, first_block).transpose(0, 1).unsqueeze(0)
    q = query.transpose(0, 1).unsqueeze(0).to(k.dtype)
    mask = None if q_len == 1 else causal_mask(q_len, context_len, query.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1).to(query.dtype)
