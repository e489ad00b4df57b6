"""A pool's contents in another precision and size (``converted``): the rows read back to
the model's own domain and written again in the new layout."""
from collections import OrderedDict

import torch

from kvchat.kernels import quant

from kvchat.core.config import Precision
from kvchat.core.kv_sizes import SLICE_BLOCKS
from kvchat.engine.kv.cache import KVCache


def converted(old: KVCache, precision: Precision, num_blocks: int, k_centers=None, k_scales=None, fp8_scales=None,
              windows=(), release: bool = False, local_blocks: int | None = None) -> KVCache:
    """``old``'s contents in another layout and size; block ids are kept (a shrink drops
    ids >= num_blocks). A transaction: the whole new pool is allocated first and this one is
    only read, so an allocation failure at any point leaves it as it was; the caller swaps
    and drops the old. Converted ``SLICE_BLOCKS`` at a time, so the working memory above the two
    pools is bounded (``memory.slice_bytes``), not a whole layer in fp32. ``windows``,
    ``(RecentWindow, block ids, length)`` of live sequences, get their sinks and newest tokens
    as this pool holds them (exact when it is the fp16 pool). With ``release``, for when the
    two pools cannot fit side by side, the new pool grows and this one is freed layer by layer:
    the peak is one layer above the larger pool, but a failure midway leaves this pool unusable.
    ``local_blocks``: the windowed layers' ring blocks, when they change (0: none); their rows are
    then not carried over (no sequence may hold a ring: the caller checks)."""
    new = KVCache.__new__(KVCache)
    new.shape, new.num_blocks, new.block_size, new.dtype = old.shape, num_blocks, old.block_size, old.dtype
    local = old.local_blocks if local_blocks is None else local_blocks
    new.ringed(local, old.device)
    reringed = local != old.local_blocks
    if old.block_map is not None and not reringed:  # ids past a shrink go; new ones map to ring block 0 until placed
        keep = min(num_blocks, old.num_blocks)
        new.block_map[:keep] = old.block_map[:keep]
    new.precision, new.format = Precision(precision), quant.FORMATS[Precision(precision).value]
    device = old.device
    new.rotation = quant.hadamard(old.shape.head_dim, device) if new.format.quantized else None
    new.calibrated(k_centers, k_scales, fp8_scales)
    allocate = lambda i: quant.layer_tensors(new.format, new.blocks_of(i), old.block_size,
                                             old.shape.num_kv_heads, old.shape.head_dim, old.dtype, device)
    new.layers = [None if release else allocate(i) for i in range(len(old.layers))]
    # the int modes transform keys alike, so sinks carry over between them
    new.window_storage = old.window_storage  # the same rows: the live windows and the graphs read them
    same = new.format.transform and old.format.transform == new.format.transform
    new.sink_cache = old.sink_cache.copy() if same else OrderedDict()
    for i in range(len(new.layers)):
        layer = new.layers[i] = new.layers[i] or allocate(i)
        center = new.k_centers[i] if new.k_centers is not None else None
        scale, v_scale = new.key_scale(i), new.value_scale(i)
        moved = reringed and (i in old.local or i in new.local)  # no sequence's rows in it
        keep_slots = 0 if moved else min(new.blocks_of(i), old.blocks_of(i)) * old.block_size
        for first in range(0, keep_slots, SLICE_BLOCKS * old.block_size):
            slots = torch.arange(first, min(first + SLICE_BLOCKS * old.block_size, keep_slots), device=device)
            k, v = plain_rows(old, i, slots)
            v = v / v_scale if v_scale is not None else v
            quant.write(layer, new.format, k.to(old.dtype), v.to(old.dtype), slots, new.rotation, center, scale)
        for window, block_ids, length in windows:
            sinks = min(window.sinks, length)
            for first, end in ((0, sinks), (max(sinks, length - window.size), length)):
                pos = torch.arange(first, end, device=device)
                slots = torch.tensor(block_ids, device=device)[pos // old.block_size] * old.block_size \
                    + pos % old.block_size
                k, v = plain_rows(old, i, old._ring_slots(slots) if i in old.local else slots)
                v = v / v_scale if v_scale is not None else v
                window.store(i, first, quant.transform_keys(k, new.rotation, center, scale),
                             quant.rotate(v, new.rotation))
        if release:
            old.layers[i] = None
    return new



def plain_rows(old: KVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at ``slots`` back in the model's own domain, fp32: ``[len(slots), kv_heads, D]``."""
    t, fmt = old.layers[layer], old.format
    k, v = (quant.read_slots(t, fmt, name, slots) for name in ("k", "v"))
    if fmt.k_bits < 16:
        k = quant.rotate(k, old.rotation)  # H is its own inverse
        if old.k_scales is not None:
            k = k / old.key_scale(layer)
        if old.k_centers is not None:
            k = k + old.k_centers[layer]
    if fmt.v_bits < 16:
        v = quant.rotate(v, old.rotation)
    if old.fp8_scales is not None:
        v = v * old.value_scale(layer)
    return k, v

