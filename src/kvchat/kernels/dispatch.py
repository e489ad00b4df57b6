"""One dispatch: Triton on CUDA, the torch reference everywhere else.

On CUDA, writes go through the fused kernel (no host sync to find padding slots) and single-token
decode through the paged decode kernel; prefill chunks use SDPA over the context in a temporary
buffer (the reference path), which a quantized pool's rows reach dequantized by a kernel in one pass.
"""
import functools
import threading
from collections import OrderedDict

import torch

from kvchat.kernels import quant
from kvchat.kernels import reference


@functools.cache
def _triton_kv():
    """Loaded on first CUDA use: the CPU path never pays for importing Triton."""
    try:
        from kvchat.kernels import triton_kv
    except ImportError:  # no triton on this platform
        return None
    return triton_kv


@functools.cache
def _triton_decode():
    from kvchat.kernels import triton_decode

    return triton_decode


def use_triton(t: torch.Tensor, tensors: dict | None = None, fmt=None) -> bool:
    """On CUDA with Triton, for a pool whose shape the kernels take (``triton_kv.unsupported``);
    other shapes (a block of 24, a head_dim of 96) run on the reference, slower but right."""
    if not t.is_cuda or _triton_kv() is None:
        return False
    return tensors is None or _triton_kv().unsupported(fmt, tensors["k"].shape[1], t.shape[-1]) is None


def write_kv(tensors, fmt, key, value, slots, rotation=None, k_center=None, k_channel_scale=None,
             keep_rows=None, ring=None, prior=None) -> None:
    """``keep_rows``: as in ``quant.write``. ``ring``, ``(recent_window.RecentWindow, layer, position,
    wmeta or None)`` for one new token: on CUDA the write kernel puts its row in the window in the
    same pass (past the sinks); otherwise ``keep_rows`` stores it. ``prior``: what gives
    ``quant.write``'s ``prior`` (int4 keys), called only where a kernel does not find those rows
    in the window itself (a captured step cannot ask the host). The fused kernel never hands rows
    back, so on CUDA they are transformed once more here only when ``keep_rows`` still needs them.
    ``wmeta``, given by a captured step, holds what ``window_meta`` would make."""
    if not use_triton(key, tensors, fmt):
        return reference.write_kv(tensors, fmt, key, value, slots, rotation, k_center, k_channel_scale, keep_rows,
                                  prior() if prior else None)
    recent, layer, position, wmeta = ring if ring is not None else (None, None, -1, None)
    in_ring = recent is not None and key.shape[0] == 1 and position >= recent.sinks
    if in_ring:
        recent.note(layer, position, 1)
        wmeta = wmeta if wmeta is not None else window_meta(recent, layer, position + 1, key.device)
    rows = (recent.k[layer], recent.v[layer], wmeta, recent.sinks) if in_ring else None
    before = prior() if prior and not in_ring else None
    _triton_kv().quantize_write(tensors, fmt, key, value, slots, rotation, k_center, k_channel_scale, rows, before)
    if keep_rows is not None and not in_ring:
        keep_rows(quant.transform_keys(key.float(), rotation, k_center, k_channel_scale),
                  quant.rotate(value.float(), rotation))


_STEP: dict = {}  # (name, device) -> {values: tensor}, newest last
STEP_TENSORS = 64  # per name: every row of a batch (MAX_RUNNING) with room to spare
_STEP_LOCK = threading.Lock()


def _step_tensor(name: str, values: tuple, device) -> torch.Tensor:
    """``values`` as an int32 tensor on ``device``, made once while they are among the last
    ``STEP_TENSORS`` asked for: a step's length or window bounds are the same for every layer, so
    one host-to-device copy per row a step. Kept by value, not only the last: a batch's rows
    alternate, and each row's values were copied again at each layer (about 512 blocking copies a
    step at 8 rows and 32 layers). Nothing writes to these tensors, and no captured graph reads
    them: a captured step hands in tensors of its own (``context_lens``, ``wmeta``), which a batch
    captured per bucket will need too, as these may be dropped."""
    with _STEP_LOCK:  # two engines' threads (a model switch, a bench) may ask at once
        made = _STEP.setdefault((name, device), OrderedDict())
        hit = made.get(values)
        if hit is None:
            hit = made[values] = torch.tensor(values, device=device, dtype=torch.int32)
            if len(made) > STEP_TENSORS:
                made.popitem(last=False)
        else:
            made.move_to_end(values)
        return hit


def window_meta(recent, layer: int, length: int, device) -> torch.Tensor:
    """What the kernels read of a window after the step that makes it ``length`` long, as int32
    ``[s, first, ring row of the newest, newest position]`` (``engine.kv.recent_window.RecentWindow.bounds``)."""
    return _step_tensor("window", (*recent.bounds(layer, length), recent.ring_row(length - 1), length - 1), device)


def paged_attention(query, tensors, fmt, block_table, context_len, scale, first_block=None, rotation=None,
                    k_channel_scale=None, window=None, context_lens=None, fresh=None, wmeta=None,
                    band: reference.Band = reference.PLAIN) -> torch.Tensor:
    """``window``: ``(recent_window.RecentWindow, layer)``. ``context_lens``, ``[1]`` int32 equal to
    ``context_len``, and ``wmeta`` (``window_meta``) let a captured CUDA step read the length and
    the window's bounds from tensors it updates in place; the block table may then be padded past
    the length. ``fresh`` and ``band``: as in ``reference.paged_attention``; one new token is in
    the window anyway."""
    length = context_len
    if window is not None and fresh is not None and window[0].end[window[1]] == context_len - query.shape[0]:
        length = context_len - query.shape[0]  # a chunk that attends before its rows are written
    held = window[0].bounds(window[1], length) if window is not None else None
    if query.shape[0] == 1 and use_triton(query, tensors, fmt):
        lens = context_lens if context_lens is not None else _step_tensor("lens", (context_len,), query.device)
        rows = None
        if held is not None:
            recent, layer = window
            wmeta = wmeta if wmeta is not None else window_meta(recent, layer, context_len, query.device)
            rows = (recent.k[layer], recent.v[layer], recent.sinks, wmeta)
        return _triton_decode().paged_decode(query, tensors, fmt, block_table[None].to(torch.int32), lens, scale,
                                             rotation, k_channel_scale, window=rows, band=band)
    rows = window[0].rows(window[1], length) if held is not None else None
    read_rows = _triton_kv().dequantize_rows if fmt.quantized and use_triton(query, tensors, fmt) else None
    return reference.paged_attention(query, tensors, fmt, block_table, context_len, scale, first_block, rotation,
                                     k_channel_scale, rows, fresh, read_rows, band)
