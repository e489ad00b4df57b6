"""What compiling the decode step needs on this machine, and where its caches go."""
import builtins
import functools
import os
import threading

from kvchat.core.paths import cache_dir
from kvchat.engine import toolchain


def cpu_compile_missing() -> str | None:
    """Why inductor cannot compile for the CPU here, or None. It builds C++ against Python's
    headers: the system's compiler when there is one, else the one that travels with kvchat
    (toolchain.py), which this call sets inductor and Triton to use. A packaged app with neither
    decodes eagerly, and says so once."""
    return toolchain.configure()[1]


def use_disk_cache() -> None:
    """Inductor's FX-graph and kernel caches in kvchat's cache dir, so that they are where the user
    expects kvchat's files and a second start finds them. Set, not defaulted: inductor writes its
    own default into the environment the first time anything asks it for its cache dir. Every
    compile comes here first."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache())
    use_own_headers()


def inductor_cache():
    """A folder per instruction set ATen runs (``ATEN_CPU_CAPABILITY`` picks one): inductor's
    cache keys leave it out, and a step compiled for AVX-512 and then loaded with the override
    set to avx2 decoded token 0 for ever (fp32 weights; a fresh cache was right)."""
    import torch

    return cache_dir() / "inductor" / torch.backends.cpu.get_cpu_capability().lower()


def use_own_headers() -> None:
    """The toolchain set up, a step compiled by name (``--decode compiled``) included, which never
    asks what is missing, and inductor's precompiled header in kvchat's own folder
    (``toolchain.own_precompiled_headers``). Here, where a compile follows, not at a model's load:
    it imports inductor's codecache (about 65 ms)."""
    chain = toolchain.configure()[0]
    if chain is not None:
        toolchain.own_precompiled_headers(chain)


def confine_fx_patches() -> None:
    """While torch.fx's tracer traces (inductor's compile does, via make_fx), it swaps
    ``nn.Module.__call__`` and ``__getattr__`` for its own, process-wide. A compile on one thread
    then sent the eager step's module calls on the engine thread through the tracer, and a reply
    failed ("module is not installed as a submodule"). Each swap is confined here to the thread
    that traces; every other thread keeps what was there."""
    from torch.fx import _symbolic_trace as fx_trace

    patcher = fx_trace._Patcher
    if getattr(patcher, "_kvchat_confined", False):
        return
    patch, patch_method = patcher.patch, patcher.patch_method

    def confined(original, replacement):
        tracer_thread = threading.get_ident()

        @functools.wraps(replacement)
        def call(*args, **kwargs):
            chosen = replacement if threading.get_ident() == tracer_thread else original
            return chosen(*args, **kwargs)
        return call

    def confined_patch(self, frame_dict, name, new_fn, deduplicate=True):
        original = frame_dict[name] if name in frame_dict else getattr(builtins, name)
        return patch(self, frame_dict, name, confined(original, new_fn), deduplicate)

    def confined_patch_method(self, cls, name, new_fn, deduplicate=True):
        return patch_method(self, cls, name, confined(getattr(cls, name), new_fn), deduplicate)

    patcher.patch, patcher.patch_method = confined_patch, confined_patch_method
    patcher._kvchat_confined = True
