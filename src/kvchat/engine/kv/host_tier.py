"""The host-RAM tier under the pool: blocks evicted from the pool, copied here instead of lost.

Keyed by the prefix cache's chained block hash (model identity, KV layout and every token before),
so an entry names exactly the bytes it holds. Capped in bytes, least recently used first; what
leaves goes to the disk tier (the caller's ``spill``), then its buffers to the next block
(``PinnedBuffers``).
"""
from collections import OrderedDict
from dataclasses import dataclass

import psutil
import torch

from kvchat.engine.kv.pinned import PinnedBuffers

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
    buffers: PinnedBuffers | None = None  # where ``tensors`` came from, and go back to (``release``)
    reading: object = None  # CUDA: the event of the last copy to the device that reads ``tensors``

    @property
    def nbytes(self) -> int:
        parts = list(self.tensors.values()) + list(self.sinks or ())
        return sum(t.numel() * t.element_size() for t in parts)

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()
            self.ready = None

    def release(self) -> None:
        """The block left the host tier: its buffers go to the next block. It holds no tensors after."""
        if self.buffers is not None:
            for t in self.tensors.values():
                self.buffers.give(t, self.reading)
        self.tensors, self.buffers = {}, None


class HostTier:
    def __init__(self, cap_bytes: int | None = None, device="cpu"):
        self.cap_bytes = default_cap() if cap_bytes is None else max(0, int(cap_bytes))
        self.buffers = PinnedBuffers(device)
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
        """Keep ``block``; returns what no longer fits (oldest first), for the disk tier, which
        releases each (``StoredBlock.release``). A block larger than the whole cap is handed
        straight back."""
        if hash_ in self.entries:
            self.touch(hash_)
            block.release()
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
        block.release()
        return True

    def clear(self) -> None:
        for block in self.entries.values():
            block.release()
        self.entries.clear()
        self.used = 0
        self.buffers.clear()


def copy_out(layers: list[dict], block_id: int, buffers: PinnedBuffers) -> StoredBlock:
    """A block's tensors, ``[layers, 1, ...]``, copied into host buffers (``buffers``), as a
    ``StoredBlock`` without its tokens (the caller's). On CUDA a side stream copies into pinned
    buffers after the work queued so far (a prefill chunk's step is not waited for by the host: a
    chunk cancelled by Stop may still be writing the block), and the compute stream waits for the
    copy before its next work, which may overwrite the block; neither waits on the host, which waits
    for the copy only where it reads it (``StoredBlock.wait``)."""
    device = layers[0]["k"].device
    out = {n: buffers.take((len(layers), 1, *t.shape[1:]), t.dtype) for n, t in layers[0].items()}
    if device.type != "cuda":
        for n, dst in out.items():
            torch.stack([layer[n][block_id] for layer in layers], out=dst[:, 0])
        return StoredBlock((), None, out, buffers=buffers)
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the block's last rows are written
    with torch.cuda.stream(stream):
        for n, dst in out.items():
            src = torch.stack([layer[n][block_id] for layer in layers]).unsqueeze(1)
            dst.copy_(src, non_blocking=True)
            src.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    torch.cuda.current_stream(device).wait_event(event)
    return StoredBlock((), None, out, ready=event, buffers=buffers)


def copy_in(blocks: list[StoredBlock], write, names: list[str], device) -> None:
    """Hand ``write`` (``KVCache.write_blocks``' tensors -> None) the blocks' tensors joined along
    the block axis, on the device. On CUDA the host-to-device copies and the write run on the side
    stream, from pinned buffers without the host waiting; the compute stream waits for them before
    its next work, and a block's buffers are reused only after the copy that read them."""
    if device.type != "cuda":
        write({n: torch.cat([b.tensors[n] for b in blocks], dim=1) for n in names})
        return
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # a step queued before may still use the blocks
    with torch.cuda.stream(stream):
        joined = {}
        for n in names:
            first = blocks[0].tensors[n]
            joined[n] = torch.empty((first.shape[0], len(blocks), *first.shape[2:]), dtype=first.dtype, device=device)
            for j, b in enumerate(blocks):
                joined[n][:, j:j + 1].copy_(b.tensors[n], non_blocking=True)
        write(joined)
        for t in joined.values():
            t.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    torch.cuda.current_stream(device).wait_event(event)
    for b in blocks:
        b.reading = event


_side_streams: dict = {}


def side_stream(device):
    """One copy stream per device, for the tiers' copies."""
    return _side_streams.setdefault(device, torch.cuda.Stream(device))
