"""One sequence's newest tokens and its first ones (the attention sinks) kept in full precision beside
a quantized pool, per layer: the window the kernels read instead of the pool's rows for those
positions. State of a sequence, owned by the engine's KV layer; the kernels read its tensors and
bounds (``kernels/dispatch.py``, ``kernels/reference.py``)."""
import weakref

import torch

from kvchat.core.kv_format import SINKS, WINDOW, window_bytes


class WindowStorage:
    """The rows of a window, ``[layers, sinks + size, kv_heads, D]`` for K and V, which windows
    take in turn (``RecentWindow(storage=...)``): a captured CUDA graph reads these tensors, so a
    window made on the same storage replays the graphs an earlier one captured. ``holder`` is the
    window whose rows they are now; any other window on them is stale."""

    def __init__(self, layers: int, rows: int, kv_heads: int, head_dim: int, dtype, device):
        self.k = torch.zeros(layers, rows, kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.holder = lambda: None  # a weak reference to the window that holds the rows


class RecentWindow:
    """One sequence's tokens kept in full precision, per layer, transformed but not quantized: its
    first ``sinks`` positions (attention sinks: most queries look at them) in rows ``[0, sinks)``,
    and its newest ``size`` in a ring after them, indexed by position. ``start``/``end`` per layer
    bound the positions written to the ring since the last gap. On a shared ``storage`` the new
    window takes the rows over (``take``; a capture that writes nothing borrows them without)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype, device, size: int = WINDOW,
                 sinks: int = SINKS, storage: WindowStorage | None = None, take: bool = True):
        self.size, self.sinks = size, sinks
        self.storage = storage or WindowStorage(layers, sinks + size, kv_heads, head_dim, dtype, device)
        self.released = False  # its sequence ended (a next turn may still take it over)
        if take:
            self.storage.holder = weakref.ref(self)
        self.k, self.v = self.storage.k, self.storage.v
        self.start = [0] * layers
        self.end = [0] * layers
        self.sink_len = [0] * layers
        self._last_index = (None, None)

    @property
    def current(self) -> bool:
        """Its rows are still its own: no later window took the storage."""
        return self.storage.holder() is self

    @classmethod
    def nbytes(cls, layers: int, kv_heads: int, head_dim: int, full_bytes: int, size: int = WINDOW,
               sinks: int = SINKS) -> int:
        return window_bytes(layers, kv_heads, head_dim, full_bytes, size, sinks)

    def store(self, layer: int, first_pos: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """``key``/``value`` ``[T, kv_heads, D]``, transformed, for positions ``first_pos ..``."""
        n = key.shape[0]
        if first_pos < self.sinks:
            m = min(self.sinks, first_pos + n) - first_pos
            self.k[layer, first_pos:first_pos + m] = key[:m].to(self.k.dtype)
            self.v[layer, first_pos:first_pos + m] = value[:m].to(self.v.dtype)
            self.sink_len[layer] = first_pos + m
        keep = min(n, self.size)
        index = self.sinks + torch.arange(first_pos + n - keep, first_pos + n, device=self.k.device) % self.size
        self.k[layer].index_copy_(0, index, key[n - keep:].to(self.k.dtype))
        self.v[layer].index_copy_(0, index, value[n - keep:].to(self.v.dtype))
        self.note(layer, first_pos, n)

    def rewind(self, length: int) -> None:
        """Go on from position ``length``: a new sequence that shares the tokens before it (a
        chat's next turn) keeps the rows this one holds of them, exact, instead of reading them
        back quantized."""
        for layer, (start, end) in enumerate(zip(self.start, self.end)):
            held = max(start, end - self.size)  # older positions' rows were overwritten
            self.start[layer] = held if held <= length <= end else length
            self.end[layer] = length
        self.sink_len = [min(n, length) for n in self.sink_len]
        self._last_index = (None, None)

    def save(self, first: int, end: int) -> tuple:
        """What writing positions ``first .. end`` will overwrite in the ring (rows of positions a
        ring's length earlier), for ``restore``."""
        with torch.inference_mode():
            index = torch.tensor([self.ring_row(p) for p in range(first, end)], device=self.k.device)
            return first, index, self.k.index_select(1, index), self.v.index_select(1, index)

    def restore(self, saved: tuple, length: int) -> None:
        """Back to ``length`` positions after positions from ``saved``'s first on were written and
        those from ``length`` on taken back (a speculative check's rejected tokens): the ring rows
        they overwrote are put back, so every later read is the one it would have been."""
        first, index, k, v = saved
        keep = max(0, length - first)
        with torch.inference_mode():  # the rows the steps wrote are inference tensors
            self.k.index_copy_(1, index[keep:], k[:, keep:])
            self.v.index_copy_(1, index[keep:], v[:, keep:])
        self.end = [min(end, length) for end in self.end]
        self.sink_len = [min(n, length) for n in self.sink_len]
        self._last_index = (None, None)

    def ring_row(self, position: int) -> int:
        return self.sinks + position % self.size

    def note(self, layer: int, first_pos: int, n: int) -> None:
        """Positions ``first_pos ..`` are in the ring now (a write kernel put them there)."""
        if first_pos != self.end[layer]:  # not a continuation (a new turn, a rewind): start over
            self.start[layer] = first_pos
        self.end[layer] = first_pos + n

    def bounds(self, layer: int, length: int) -> tuple[int, int] | None:
        """``(s, first)``: of the positions ``.. length`` it holds ``0 .. s`` and ``first .. length``;
        None if this layer was not written up to ``length``."""
        if self.end[layer] != length:
            return None
        s = min(self.sink_len[layer], length)
        return s, max(self.start[layer], length - self.size, s)

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor | None:
        """The K rows of positions ``start .. end`` when it holds them all (written up to ``end``)."""
        held = self.bounds(layer, end)
        if held is None or held[1] > max(start, held[0]):  # a position between the sinks and the ring
            return None
        rows = [p if p < held[0] else self.ring_row(p) for p in range(start, end)]
        return self.k[layer].index_select(0, torch.tensor(rows, device=self.k.device))

    def rows(self, layer: int, length: int) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        """``(s, first, K, V)``: the rows it holds among ``.. length`` (``bounds``), gathered."""
        held = self.bounds(layer, length)
        if held is None:
            return None
        index = self._index(*held, length)
        return *held, self.k[layer].index_select(0, index), self.v[layer].index_select(0, index)

    def _index(self, s: int, first: int, length: int) -> torch.Tensor:
        """Rows of the positions held; the same for every layer of a step, so made once."""
        if self._last_index[0] != (s, first, length):
            rows = list(range(s)) + [self.sinks + p % self.size for p in range(first, length)]
            self._last_index = ((s, first, length), torch.tensor(rows, dtype=torch.long, device=self.k.device))
        return self._last_index[1]

    def complete_sinks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sink rows of every layer, once all are written: ``[layers, sinks, kv_heads, D]``."""
        if min(self.sink_len) < self.sinks:
            return None
        return self.k[:, :self.sinks].clone(), self.v[:, :self.sinks].clone()

    def set_sinks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Sink rows computed by an earlier sequence with the same first tokens (their K/V depend on
        nothing else)."""
        self.k[:, :self.sinks], self.v[:, :self.sinks] = k, v
        self.sink_len = [self.sinks] * len(self.sink_len)
