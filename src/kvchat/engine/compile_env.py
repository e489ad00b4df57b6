"""What compiling the decode step needs on this machine, and where its caches go."""
import os
import shutil
import sysconfig
from pathlib import Path

from kvchat.core.paths import cache_dir


def cpu_compile_missing() -> str | None:
    """Why inductor cannot compile for the CPU here (it builds C++ against Python's headers), or None.
    A packaged app on a machine without a compiler decodes eagerly, and says so once."""
    if not (shutil.which("g++") or shutil.which("c++")):
        return "decoding without compilation: no C++ compiler (g++) found"
    if not Path(sysconfig.get_paths()["include"], "Python.h").is_file():
        return "decoding without compilation: Python's headers (Python.h) are missing"
    return None


def use_disk_cache() -> None:
    """Inductor's FX-graph and kernel caches in kvchat's cache dir, so that they are where the user
    expects kvchat's files and a second start finds them. Set, not defaulted: inductor writes its
    own default into the environment the first time anything asks it for its cache dir."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
