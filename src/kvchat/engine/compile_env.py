"""What compiling the decode step needs on this machine, and where its caches go."""
import os

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
    own default into the environment the first time anything asks it for its cache dir."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
