"""The peak bytes of tensors alive during an operation, on any device, the CPU included.

CUDA has ``torch.cuda.max_memory_allocated``; the CPU has nothing like it, and the planner's
reserves must be checked here, where no GPU is. Every op's outputs pass through a dispatch mode,
so their storages are counted from creation until Python and C++ both drop them. What a kernel
allocates inside itself and frees before returning (a fused kernel's workspace) is not seen.
"""
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorPeak(TorchDispatchMode):
    """``with TensorPeak() as p: ...`` then ``p.peak``: the most bytes of tensors made inside the
    block that were alive at once (tensors made before it are not counted)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, weakref.ref]] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage, inputs: set[int]) -> None:
        key = storage.data_ptr()
        if not key or key in inputs or key in self.live:  # empty, a view, or an in-place op's result
            return
        self.live[key] = (storage.nbytes(), weakref.ref(storage, lambda _, k=key: self._free(k)))
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)

    def _free(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, None))
        self.now -= nbytes
