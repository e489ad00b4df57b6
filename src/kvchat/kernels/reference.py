"""Pure-torch paged KV ops: the executable spec of the pool, and the CPU path.

A token at position ``p`` of a sequence lives at slot ``block_table[p // block_size] * block_size
+ p % block_size``; slot ``-1`` is padding and is never written. The per-layer tensors and the
quantized layout are defined in ``quant.py``.
"""
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kvchat.kernels import quant
from kvchat.core.kv_format import READ_SLICE
from kvchat.kernels.quant import KVFormat

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


class Band(NamedTuple):
    """What a layer's attention adds to plain causal attention, as transformers passes it: a
    sliding window (query ``p`` sees positions ``p - window + 1 .. p``: Mistral v0.1, Gemma's local
    layers, Qwen2 with ``use_sliding_window``) and a soft cap on the scores (``cap * tanh(s / cap)``:
    Gemma 2). ``None`` for each when absent."""
    window: int | None = None
    softcap: float | None = None

    def changes(self, context_len: int) -> bool:
        """Whether attention over ``context_len`` positions differs from plain causal attention."""
        return bool(self.softcap) or self.window is not None and self.window < context_len


PLAIN = Band()


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``, Gemma 2's bound on scores and logits; ``x`` itself when no cap."""
    return torch.tanh(x / cap) * cap if cap else x


def paged_attention(query: torch.Tensor, tensors: dict, fmt: KVFormat, block_table: torch.Tensor,
                    context_len: int, scale: float, first_block: int | None = None,
                    rotation: torch.Tensor | None = None, k_channel_scale: torch.Tensor | None = None,
                    window: tuple | None = None, fresh: tuple | None = None, read_rows=None,
                    band: Band = PLAIN) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, heads, D]``, the last T tokens of a sequence of
    ``context_len`` tokens whose K/V are already in the pool. ``window``, from
    ``engine.kv.recent_window.RecentWindow.rows``, replaces the quantized rows it holds. ``fresh``, the query tokens'
    own K/V as ``quant.write`` transformed them (before rounding), serves those T positions: a
    prefill chunk then attends to itself exactly and reads only the earlier context quantized, as
    vLLM's chunked prefill does. ``read_rows``: as in ``sequence_rows``. ``band``: the layer's
    window and soft cap. Returns ``[T, heads, D]``."""
    banded = band.changes(context_len)
    if fresh is None and not banded and in_place(query, fmt, context_len):  # a plain pool: read where it lies
        return prefill_in_place(query, tensors, block_table, context_len, scale)
    dtype = query.dtype
    q = query
    if fmt.k_bits < 16:  # rotated in fp32: in bf16, H @ H is 0.9998 I at D=128
        q = quant.transform_queries(query.float(), rotation.float(), k_channel_scale).to(dtype)
    if not banded and in_place(query, fmt, context_len, fresh):  # the earlier context dequantized, the chunk's own exact
        past = _dequantized_past(tensors, fmt, block_table, context_len - query.shape[0], first_block, dtype, window)
        out = split_attention(q, past, fresh[0].to(dtype), fresh[1].to(dtype), scale)
    else:
        k, v = (sequence_rows(tensors, fmt, name, block_table, context_len, first_block, dtype, fresh, window,
                              query.shape[-1], read_rows) for name in ("k", "v"))
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        out = banded_attention(q, k, v, scale, band) if banded else causal_attention(q, k, v, scale)
        out = out[0].transpose(0, 1)
    return quant.rotate(out.float(), rotation.float()).to(dtype) if fmt.v_bits < 16 else out


_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)  # gives the log-sum-exp
MAX_RUNS = 8  # runs of consecutive blocks attended where they lie; a context in more pieces is gathered


def in_place(query: torch.Tensor, fmt: KVFormat, context_len: int, fresh: tuple | None = None) -> bool:
    """A CPU prefill chunk after earlier context, over a plain pool or with its own K/V at hand."""
    return (_FLASH is not None and not query.is_cuda and 1 < query.shape[0] < context_len
            and (fresh is not None or fmt.k_bits == 16 and fmt.v_bits == 16))


def prefill_in_place(query: torch.Tensor, tensors: dict, block_table: torch.Tensor, context_len: int,
                     scale: float) -> torch.Tensor:
    """A prefill chunk's attention over a plain pool without a copy of the context: each run of
    consecutive blocks before the chunk is read in place (a view), the chunk's own K/V from its
    few blocks. Gathering the context into one tensor per layer and chunk cost as much as the
    attention itself on a 6,000-token chat (CPU memory bandwidth). ``query`` ``[T, H, D]``."""
    t = query.shape[0]
    blocks, offset = slice_table(block_table, context_len - t, t, tensors["k"].shape[1])
    k, v = (tensors[n].index_select(0, blocks).flatten(0, 1)[offset:offset + t] for n in ("k", "v"))
    return split_attention(query, _past(tensors, block_table, context_len - t), k, v, scale)


def split_attention(query: torch.Tensor, past: list, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``query`` ``[T, H, D]`` whose own K/V are ``k``/``v`` ``[T, Hkv, D]``,
    after the context in ``past`` (``(k, v)`` pieces ``[n, Hkv, D]``, in any order): the context
    precedes every query and needs no mask, so each piece goes to the fused kernel as it is, each
    KV head's query group folded into its rows; the parts are merged by log-sum-exp. A masked SDPA
    over one concatenated context cost a third more on the CPU."""
    t, heads, d = query.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    folded = query.transpose(0, 1).reshape(1, kv_heads, g * t, d)
    parts = [part for pk, pv in past for part in _context_parts(folded, pk, pv, scale)]
    k, v = (x.transpose(0, 1).repeat_interleave(g, 0)[None] for x in (k, v))
    out, lse = _FLASH(query.transpose(0, 1)[None], k, v, is_causal=True, scale=scale)[:2]
    parts.append((out.reshape(folded.shape), lse.reshape(1, kv_heads, g * t)))
    return _merge(parts).to(query.dtype).reshape(heads, t, d).transpose(0, 1)


MIN_SPLIT = 512  # keys per part, at least: the kernel's own block of keys


def _context_parts(folded: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> list:
    """``split_attention``'s parts for one context piece ``[n, Hkv, D]``. The kernel shares out
    (KV head, block of query rows) pairs among the threads: a few new tokens make one block a head,
    3 pairs for the starter's 3 KV heads, and one of 2 threads would do two while the other waits.
    So the keys are cut into ``s`` equal parts, a batch of one call, and ``s`` times the pairs
    share out evenly (then merged like the other parts)."""
    s = _splits(folded.shape[1], folded.shape[2])
    n = k.shape[0] // s
    if s == 1 or n < MIN_SPLIT:
        return [_FLASH(folded, k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale=scale)[:2]]
    ks, vs = (x[:n * s].unflatten(0, (s, n)).permute(0, 2, 1, 3) for x in (k, v))
    out, lse = _FLASH(folded.expand(s, -1, -1, -1), ks, vs, scale=scale)[:2]
    parts = [(out[i:i + 1], lse[i:i + 1]) for i in range(s)]
    if n * s < k.shape[0]:
        parts += _context_parts(folded, k[n * s:], v[n * s:], scale)
    return parts


def _splits(kv_heads: int, rows: int) -> int:
    """How many parts make the kernel's work items a multiple of the threads. Its block of query
    rows (ATen's CPU flash attention) is 32 rows under 192, 64 under 768, else 256."""
    block = 32 if rows < 192 else 64 if rows < 768 else 256
    items, threads = kv_heads * -(-rows // block), torch.get_num_threads()
    return threads // math.gcd(items, threads)


def _dequantized_past(tensors: dict, fmt: KVFormat, block_table, past: int, first_block, dtype,
                      window: tuple | None) -> list:
    """K/V of positions ``0 .. past`` as pieces for ``split_attention``: the window's full-precision
    rows as one, the pool's rows between them dequantized a slice at a time, each slice its own
    piece (no copy into one tensor, none of the rows the window holds)."""
    s, first, wk, wv = _before(window, past) if window is not None else (0, past, None, None)
    pieces = [(wk.to(dtype), wv.to(dtype))] if wk is not None and wk.shape[0] else []
    for start in range(s, first, READ_SLICE):
        n = min(READ_SLICE, first - start)
        pieces.append(tuple(read_positions(tensors, fmt, name, block_table, start, n, first_block).to(dtype)
                            for name in ("k", "v")))
    return pieces


def read_positions(tensors: dict, fmt: KVFormat, name: str, block_table, first: int, n: int,
                   first_block: int | None) -> torch.Tensor:
    """K or V of positions ``first .. first + n`` in fp32 ``[n, kv_heads, D]`` (int8 x an fp16 scale
    is not exact in bf16): only the blocks holding them are read."""
    bs = tensors[name].shape[1]
    blocks, offset = slice_table(block_table, first, n, bs)
    lead = None if first_block is None else first_block + first // bs
    return quant.read(tensors, fmt, name, blocks, offset + n, lead, torch.float32)[offset:]


def _before(window: tuple, n: int) -> tuple:
    """``window`` rows (``engine.kv.recent_window.RecentWindow.rows``) of the positions before ``n`` only."""
    s, first, wk, wv = window
    keep, sinks = max(0, n - first), min(s, n)
    rows = lambda w: torch.cat([w[:sinks], w[s:s + keep]])
    return sinks, min(first, n), rows(wk), rows(wv)


def _past(tensors: dict, block_table: torch.Tensor, past: int) -> list:
    """K/V ``[n, kv_heads, D]`` of positions ``0 .. past``: a view per run of consecutive blocks,
    or one gathered copy when the runs are many."""
    bs = tensors["k"].shape[1]
    ids = block_table[:-(-past // bs)].tolist()
    breaks = [i for i in range(1, len(ids)) if ids[i] != ids[i - 1] + 1]
    if len(breaks) >= MAX_RUNS:
        return [tuple(quant.gather(tensors[n], block_table[:len(ids)], past, None) for n in ("k", "v"))]
    return [tuple(tensors[name][ids[lo]:ids[lo] + hi - lo].flatten(0, 1)[:min(hi * bs, past) - lo * bs]
                  for name in ("k", "v")) for lo, hi in zip([0] + breaks, breaks + [len(ids)])]


def _merge(parts: list) -> torch.Tensor:
    """Softmax-weighted sum of partial attentions ``(out, lse)`` over disjoint key sets."""
    if len(parts) == 1:
        return parts[0][0]
    total = torch.logsumexp(torch.stack([lse for _, lse in parts]), 0)
    return sum(o.float() * (lse - total).exp().unsqueeze(-1) for o, lse in parts)




def sequence_rows(tensors: dict, fmt: KVFormat, name: str, block_table, context_len: int, first_block,
                  dtype, fresh: tuple | None, window: tuple | None, head_dim: int, read_rows=None) -> torch.Tensor:
    """A sequence's K or V ``[context_len, kv_heads, D]`` in the model's dtype, as attention reads
    it: the pool's rows (a view when they are plain and consecutive), the last ones from ``fresh``,
    the window's rows over their quantized copies. Dequantized in fp32 (int8 x an fp16 scale is
    not exact in bf16) a slice at a time, so the fp32 copy never spans a long context.
    ``read_rows(tensors, fmt, name, block_table, first, n, out)``, when given, fills the pool's rows
    instead of those slices, with the same values (``triton_kv.dequantize_rows``, on CUDA: one pass
    over the codes instead of a gather, an fp32 copy and a cast per layer and chunk)."""
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    if bits == 16 and fresh is None:
        return quant.read(tensors, fmt, name, block_table, context_len, first_block, dtype)
    past = context_len - fresh[0].shape[0] if fresh is not None else context_len
    out = torch.empty(context_len, tensors[name].shape[2], head_dim, dtype=dtype, device=tensors[name].device)
    if read_rows is not None:
        read_rows(tensors, fmt, name, block_table, 0, past, out[:past])
    else:
        for first in range(0, past, READ_SLICE):
            n = min(READ_SLICE, past - first)
            out[first:first + n] = read_positions(tensors, fmt, name, block_table, first, n, first_block)
    if fresh is not None:
        out[past:] = fresh[0 if name == "k" else 1]
    if window is not None and bits < 16:
        s, first, wk, wv = window
        quant.substitute(out, s, first, wk if name == "k" else wv)
    return out


def slice_table(block_table: torch.Tensor, first: int, n: int, block_size: int) -> tuple[torch.Tensor, int]:
    """The blocks holding positions ``first .. first + n`` and the offset of ``first`` in them."""
    lo, hi = first // block_size, -(-(first + n) // block_size)
    return block_table[lo:hi], first - lo * block_size


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     fold_groups: bool | None = None) -> torch.Tensor:
    """SDPA for ``q`` ``[1, H, T, D]``, the last T of the ``S`` positions of ``k``/``v``
    ``[1, Hkv, S, D]``, called so that a fused kernel takes it: the math kernel would build the
    ``[H, T, S]`` scores in fp32 (5 GiB for an 8B model's 512-token chunk at 32k context).
    A chunk that starts the sequence is plain causal. Later chunks need a mask, and no fused CUDA
    kernel takes a mask with grouped K/V heads. There (``fold_groups``, CUDA by default) each KV
    head's query heads are folded into its query rows, ``[1, Hkv, g*T, D]``: K/V are read as they
    are, and only the mask grows g-fold. The CPU's fused kernel takes a mask with groups."""
    q_len, kv_len, heads, kv_heads = q.shape[2], k.shape[2], q.shape[1], k.shape[1]
    if q_len == 1 or q_len == kv_len:
        return F.scaled_dot_product_attention(q, k, v, is_causal=q_len > 1, scale=scale,
                                              enable_gqa=heads != kv_heads)
    mask = causal_mask(q_len, kv_len, q.device)
    if heads == kv_heads or not (q.is_cuda if fold_groups is None else fold_groups):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=heads != kv_heads)
    g = heads // kv_heads
    folded = q.reshape(1, kv_heads, g * q_len, q.shape[-1])
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask.repeat(g, 1), scale=scale)
    return out.reshape(q.shape)


BAND_ROWS = 32  # query rows whose explicit scores are built at a time


def banded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, band: Band) -> torch.Tensor:
    """``causal_attention`` with the layer's ``band``: ``q`` ``[1, H, T, D]`` the last T of the S
    positions of ``k``/``v`` ``[1, Hkv, S, D]``. Only the keys some query's window reaches are used,
    as they are (a view, in the model's dtype); each KV head's query group is folded into its rows,
    as ``causal_attention`` folds them. The scores are explicit (no fused kernel takes a soft cap):
    the products in the model's dtype, as transformers' eager attention makes them, then capped,
    masked and normalized in fp32, ``BAND_ROWS`` query rows at a time, so the working set is
    ``H x BAND_ROWS x S`` scores."""
    t, s, kv_heads, d = q.shape[2], k.shape[2], k.shape[1], q.shape[-1]
    g = q.shape[1] // kv_heads
    start = 0 if band.window is None else max(0, s - t - band.window + 1)
    k, v = k[:, :, start:], v[:, :, start:]
    q_pos = torch.arange(s - t, s, device=q.device)[:, None]
    k_pos = torch.arange(start, s, device=q.device)[None, :]
    allowed = k_pos <= q_pos
    if band.window is not None:
        allowed &= k_pos > q_pos - band.window
    out = []
    for r in range(0, t, BAND_ROWS):
        rows = min(BAND_ROWS, t - r)
        folded = q[:, :, r:r + rows].reshape(1, kv_heads, g * rows, d)
        scores = soft_cap((folded @ k.transpose(-1, -2)).float() * scale, band.softcap)
        scores = scores.masked_fill(~allowed[r:r + rows].repeat(g, 1), float("-inf"))
        out.append((scores.softmax(-1).to(v.dtype) @ v).reshape(1, kv_heads * g, rows, d))
    return torch.cat(out, 2).to(q.dtype)
