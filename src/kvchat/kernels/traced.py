"""A decode step's paged attention (write + attend) as plain torch ops, for inductor to fuse.

On the CPU the compiled decode step traces this instead of calling the ``kvchat::paged_attention``
op: as an opaque op, a layer's attention cost ~0.2 ms of Python, gathers and an SDPA call (about
40% of a starter token), for a few hundred KB of K/V. Traced, the gather, softmax and weighted sum
become a few fused C++ loops in the step's own graph: 61 -> 86 tok/s on the starter.

Only the full-precision pool. Traced the same way, with quantize-on-write, dequantize, rotation
and the window's rows, an int8 pool compiled in 182 s cold (fp16: 89 s) and decoded at 67 tok/s,
and int4 took 222 s and ran at 35 tok/s: quantized pools keep the op inside the compiled graph.

Everything a step changes is read from tensors (slot, padded block table, length), so one graph
serves every step; no Python branch looks at a tensor's value. The twin is
``reference.paged_attention`` with ``reference.write_kv``.
"""
import torch

from kvchat.kernels.quant import KVFormat
from kvchat.kernels.reference import PLAIN, Band, soft_cap


def supports(fmt: KVFormat) -> bool:
    return not fmt.quantized


def write(layer: dict, key: torch.Tensor, value: torch.Tensor, slot: torch.Tensor) -> None:
    """Each row's ``key``/``value`` ``[rows, kv_heads, D]`` into its ``slot`` ``[rows]`` (one token of
    each sequence of a batch). A slot of -1 (a warm-up step, a batch's padding row) rewrites slot 0
    with what it holds: the step has no branch on the slot."""
    keep = (slot >= 0).view(-1, 1, 1)
    at = slot.clamp(min=0)
    for name, x in (("k", key), ("v", value)):
        flat = layer[name].view(-1, *layer[name].shape[2:])
        flat.index_copy_(0, at, torch.where(keep, x.to(flat.dtype), flat[at]))


def attend(layer: dict, query: torch.Tensor, table: torch.Tensor, length: torch.Tensor,
           scale: float, band: Band = PLAIN) -> torch.Tensor:
    """Attention of each sequence's ``query`` ``[rows, heads, D]`` over the ``length`` ``[rows]``
    positions whose K/V are in its row of ``table`` ``[rows, blocks]`` (one sequence: ``[blocks]``);
    positions past a row's length (a padded table), and before the layer's window (``band``), are
    masked. The band is the layer's, fixed when traced."""
    if table.dim() == 1:  # one sequence: the single step's graph, as fast as before batching
        return _attend_one(layer, query, table, length, scale, band)
    k, v = (layer[name][table].flatten(1, 2).float() for name in ("k", "v"))  # [rows, positions, kv_heads, D]
    rows, positions, kv_heads, d = k.shape
    q = query.float().view(rows, kv_heads, -1, d)  # each KV head's query group
    k, v = k.transpose(1, 2)[:, :, None], v.transpose(1, 2)[:, :, None]  # [rows, kv_heads, 1, positions, D]
    scores = soft_cap((q[:, :, :, None, :] * k).sum(-1) * scale, band.softcap)  # [rows, kv_heads, group, positions]
    past = _hidden(torch.arange(positions, device=k.device), length.view(-1, 1), band)  # [rows, positions]
    scores = scores.masked_fill(past[:, None, None, :], float("-inf"))
    out = (scores.softmax(-1)[..., None] * v).sum(-2)  # [rows, kv_heads, group, D]
    return out.reshape(rows, -1, d).to(query.dtype)


def _attend_one(layer: dict, query: torch.Tensor, table: torch.Tensor, length: torch.Tensor,
                scale: float, band: Band) -> torch.Tensor:
    """``attend`` for one sequence, without the rows dimension: through the batched form the
    single step decoded the starter 8% slower (60.5 against 66.1 tok/s, int8 weights)."""
    k, v = (layer[name][table].flatten(0, 1).float() for name in ("k", "v"))  # [positions, kv_heads, D]
    kv_heads, d = k.shape[1], k.shape[2]
    q = query.float().view(kv_heads, -1, d)  # each KV head's query group
    scores = soft_cap((q[:, :, None, :] * k.transpose(0, 1)[:, None]).sum(-1) * scale, band.softcap)  # [kv_heads, group, positions]
    scores = scores.masked_fill(_hidden(torch.arange(k.shape[0], device=k.device), length, band), float("-inf"))
    out = (scores.softmax(-1)[..., None] * v.transpose(0, 1)[:, None]).sum(-2)  # [kv_heads, group, D]
    return out.reshape(1, -1, d).to(query.dtype)


def _hidden(positions: torch.Tensor, length: torch.Tensor, band: Band) -> torch.Tensor:
    """Positions the newest token (at ``length - 1``) does not see: past it, or before its window."""
    hidden = positions >= length
    return hidden | (positions <= length - 1 - band.window) if band.window is not None else hidden
