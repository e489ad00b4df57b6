"""The host-RAM tier under the pool: blocks evicted from the pool, copied here instead of lost.

Keyed by the prefix cache's chained block hash (model identity, KV layout and every token before),
so an entry names exactly the bytes it holds. Capped in bytes, least recently used first; what
leaves goes to the disk tier (the caller's ``spill``).
"""
from collections import OrderedDict
from dataclasses import dataclass

import psutil
import torch

RAM_SHARE = 4  # default cap: a quarter of the RAM free when the engine starts


def default_cap() -> int:
    return psutil.virtual_memory().available // RAM_SHARE


@dataclass(eq=False)
class StoredBlock:
    """One block as the pool holds it: every tensor a block id addresses, ``[layers, 1, ...]``, in
    the pool's own precision, and for a chain's first block of a quantized pool the full-precision
    sink rows ``(k, v)`` its window needs (``KVCache.keep_sinks``)."""
    token_ids: tuple
    parent: bytes | None
    tensors: dict[str, torch.Tensor]
    sinks: tuple | None = None
    ready: object = None  # CUDA: the event after which the pinned copy is complete

    @property
    def nbytes(self) -> int:
        parts = list(self.tensors.values()) + list(self.sinks or ())
        return sum(t.numel() * t.element_size() for t in parts)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None


class HostTier:
    def __init__(self, cap_bytes: int | None = None):
        self.cap_bytes = default_cap() if cap_bytes is None else max(0, int(cap_bytes))
        self.entries: OrderedDict[bytes, StoredBlock] = OrderedDict()
        self.used = 0
        self.hits = 0  # blocks served back to the pool

    def __contains__(self, hash_: bytes) -> bool:
        return hash_ in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def touch(self, hash_: bytes) -> None:
        self.entries.move_to_end(hash_)

    def put(self, hash_: bytes, block: StoredBlock) -> list[tuple[bytes, StoredBlock]]:
        """Keep ``block``; returns what no longer fits (oldest first), for the disk tier. A block
        larger than the whole cap is handed straight back."""
        if hash_ in self.entries:
            self.touch(hash_)
            return []
        self.entries[hash_] = block
        self.used += block.nbytes
        out = []
        while self.used > self.cap_bytes and self.entries:
            old, stored = self.entries.popitem(last=False)
            self.used -= stored.nbytes
            out.append((old, stored))
        return out

    def get(self, hash_: bytes, token_ids) -> StoredBlock | None:
        block = self.entries.get(hash_)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        self.touch(hash_)
        block.wait()
        return block

    def discard(self, hash_: bytes) -> bool:
        block = self.entries.pop(hash_, None)
        if block is None:
            return False
        self.used -= block.nbytes
        return True

    def clear(self) -> None:
        self.entries.clear()
        self.used = 0


def copy_out(layers: list[dict], block_id: int) -> tuple[dict[str, torch.Tensor], object]:
    """A block's tensors, ``[layers, 1, ...]``, copied to host memory, and the CUDA event that ends
    the copy (None on the CPU). On CUDA into pinned memory on a side stream: the compute stream waits
    for the copy before it can overwrite the block, and the host waits for it only when the block is
    read back (``StoredBlock.wait``)."""
    device = layers[0]["k"].device
    if device.type != "cuda":
        return {n: torch.stack([layer[n][block_id] for layer in layers]).unsqueeze(1) for n in layers[0]}, None
    return _copy_out_cuda(layers, block_id, device)


_side_streams: dict = {}


def _copy_out_cuda(layers, block_id, device):
    stream = _side_streams.setdefault(device, torch.cuda.Stream(device))
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)  # the block's rows are written
    out = {}
    with torch.cuda.stream(stream):
        for n in layers[0]:
            src = torch.stack([layer[n][block_id] for layer in layers]).unsqueeze(1)
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
            out[n] = dst
    current.wait_stream(stream)  # nothing overwrites the block before its copy is out
    event = torch.cuda.Event()
    event.record(stream)
    return out, event
