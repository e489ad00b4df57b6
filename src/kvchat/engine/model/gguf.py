"""What transformers' GGUF loading lacks, added around one conversion (engine/model/loading.py).

- It parses the file three times (for the tokenizer, the config and the weights), and parsing the
  starter's 49k-token vocabulary takes 2.5-4 s here each time: the same reader serves all three.
  It is parsed on entering ``converting``, so the caller can say when reading ends.
- It builds gguf's tensor-name map once per module of the model (397 times for the starter, 4-5 s
  in all), always for the same architecture and layer count: it is built once.
- It reports progress only to a terminal bar: the tensor loop's ``tqdm`` (transformers 5.x,
  ``modeling_gguf_pytorch_utils``) is replaced by a counter that calls ``progress(done, total)``
  after each tensor, so the app's bar moves per tensor and a cancel stops at the next one.

All are module attributes swapped for the duration, under a lock: one conversion at a time.
``weights_counted`` does the same for the "Loading weights" bar of any model load.
Without them (another transformers version) the conversion still works, only slower and silent.
"""
import functools
import os
import threading
from contextlib import contextmanager
from typing import Callable

_LOCK = threading.Lock()


@contextmanager
def converting(path, progress: Callable[[int, int], None]):
    """Parses ``path`` (a bad file raises here), then swaps in the reader, the map and the counter."""
    import gguf
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    with _LOCK:
        real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
        parsed = real_reader(path)
        gguf.GGUFReader = _read_once(real_reader, path, parsed)
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(real_map)  # (arch, layers) -> map
        try:
            with _bar_counted(gguf_utils, progress):
                yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


@contextmanager
def _bar_counted(module, progress: Callable[[int, int], None]):
    """``module.tqdm`` (transformers' terminal bar over a tensor loop) reports to ``progress``
    instead, for the duration; a module without one is left as it is. Callers hold their lock."""
    real_bar = getattr(module, "tqdm", None)
    if real_bar is None:
        yield
        return
    module.tqdm = lambda iterable, *args, **kwargs: Counted(iterable, progress)
    try:
        yield
    finally:
        module.tqdm = real_bar


def _read_once(reader_class, path, parsed):
    """A stand-in for GGUFReader that gives ``parsed`` for ``path``; any other file is read as usual.
    The reader is only read from (fields, tensors over a read-only memory map), so sharing it is safe."""
    target = os.path.realpath(path)

    def reader(file, *args, **kwargs):
        if args or kwargs or os.path.realpath(file) != target:
            return reader_class(file, *args, **kwargs)
        return parsed

    return reader


class Counted:
    """Iterates like the tqdm bar it replaces; after each item, ``progress(done, total)``."""

    def __init__(self, iterable, progress):
        self.items, self.progress = list(iterable), progress

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        total = len(self.items)
        self.progress(0, total)
        for done, item in enumerate(self.items, 1):
            yield item
            self.progress(done, total)


_WEIGHTS_LOCK = threading.Lock()


@contextmanager
def weights_counted(progress: Callable[[int, int], None] | None):
    """Around ``from_pretrained``: its per-tensor loop (transformers 5.x, ``core_model_loading``)
    reports ``progress(done, total)`` instead of drawing a terminal bar."""
    try:
        import transformers.core_model_loading as loading
    except ImportError:  # another transformers: the load is silent
        loading = None
    if progress is None or loading is None:
        yield
        return
    with _WEIGHTS_LOCK, _bar_counted(loading, progress):
        yield
