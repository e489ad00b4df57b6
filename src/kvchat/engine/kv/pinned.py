"""Host buffers for the KV blocks the host tier keeps, taken and given back instead of allocated
per block.

On CUDA the buffers are pinned, so that a copy to or from the GPU runs on a side stream without
the host waiting. Pinning is a page-locking system call, slow and a share of RAM the OS cannot
page out: a pinned buffer per evicted block, dropped when the block leaves the tier, asked for
that again at every eviction. Here a buffer leaving the tier waits in a free list of its shape for
the next block, with the event of the last copy that reads it; the free lists keep at most
``spare_bytes``, the rest is freed. On the CPU the same lists hold plain tensors: the same
bookkeeping, testable without a GPU.
"""
from collections import defaultdict

import torch


class PinnedBuffers:
    def __init__(self, device, spare_bytes: int = 64 << 20):
        self.pinned = torch.device(device).type == "cuda"
        self.spare_bytes = spare_bytes
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = defaultdict(list)
        self.free_bytes = 0
        self.made = 0  # buffers allocated, ever: reuse keeps it near the tier's peak

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        spare = self._free.get((tuple(shape), dtype))
        if spare:
            buffer, event = spare.pop()
            self.free_bytes -= _nbytes(buffer)
            if event is not None:
                event.synchronize()  # the copy that last read it: long gone, in practice
            return buffer
        self.made += 1
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def give(self, buffer: torch.Tensor, event=None) -> None:
        """``buffer`` is free once ``event`` (a copy still reading it; None: none) has passed."""
        if self.free_bytes + _nbytes(buffer) > self.spare_bytes:
            return  # freed: the tier shrank, its spare buffers need not outlive it
        self._free[(tuple(buffer.shape), buffer.dtype)].append((buffer, event))
        self.free_bytes += _nbytes(buffer)

    def clear(self) -> None:
        self._free.clear()
        self.free_bytes = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
