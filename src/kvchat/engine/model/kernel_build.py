"""Building kvchat's CPU kernel (``kernels/int8_rows.cpp``, with ``decode_attention.cpp`` in the same
library) for a model's int8 and 4-bit weights and an fp32 pool's attention:
once a process, with inductor's compiler and disk cache, on whichever thread asks first (the
load's own thread, the compile thread's warm-up, Auto's timing), the others waiting for it."""
import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from torch import nn

from kvchat.kernels import int8_rows

log = logging.getLogger("kvchat.weights")

_build_lock = threading.Lock()


def build_kernel() -> None:
    from kvchat.engine import toolchain
    from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

    with _build_lock:  # the load's thread and the compile thread: one builds, the other waits
        if int8_rows.built or int8_rows.failed:
            return
        if int8_rows.load_prebuilt(_libomp(toolchain)):
            log.info("int8 kernel: the prebuilt one (%s)", int8_rows.prebuilt_name())
            return
        why = cpu_compile_missing()
        if why is not None:
            log.warning("int8 decode kernel not built (%s); inductor's product instead", why)
            return
        use_disk_cache()
        started = time.perf_counter()
        if int8_rows.build():
            log.info("int8 kernel ready in %.1f s", time.perf_counter() - started)
            try:
                _built_marker().touch()
            except OSError:  # the next start builds it again before timing: slower, not wrong
                pass


def _libomp(toolchain):
    prefix = toolchain.libomp_prefix()
    return prefix / "lib" / "libomp.so" if prefix else None


def kernel_runs_here() -> bool:
    """Whether the kernel can be had here: prebuilt, or a compiler to build it."""
    from kvchat.engine import toolchain
    from kvchat.engine.compile_env import cpu_compile_missing

    return (int8_rows.prebuilt() is not None and _libomp(toolchain) is not None) or cpu_compile_missing() is None


def prebuild(folder: Path) -> Path:
    """The kernel built for a packaged app, by the bundled clang on LLVM's OpenMP (which the app
    carries, and which runs its compiled step): no -march (each variant has its target attribute),
    no C++ library or exceptions, libomp found beside the app. Returns the library's path."""
    from kvchat.engine import toolchain

    zig, omp = toolchain.zig_binary(), toolchain.libomp_prefix()
    if zig is None or omp is None:
        raise RuntimeError("prebuilding the int8 kernel needs the bundled clang (ziglang) and cmeel-libomp")
    out = folder / int8_rows.prebuilt_name()
    # no fused multiply-adds the source did not write: inductor builds with -ffp-contract=off, and
    # the prebuilt library must give its bits (the attention's merge has a plain a += w * b)
    subprocess.run([str(zig), "c++", "-O3", "-ffp-contract=off", "-shared", "-fPIC", "-fopenmp", "-fno-exceptions",
                    "-nostdlib++",
                    "-isystem", str(omp / "include"), f"-L{omp / 'lib'}", "-lomp",
                    # the app's layout: kvchat/kernels/ and cmeel.prefix/lib/ side by side
                    "-Wl,-rpath,$ORIGIN/../../cmeel.prefix/lib", "-o", str(out), *map(str, int8_rows.sources())],
                   check=True)
    return out


def kernel_identity() -> str:
    """The kernel's source, the compiler that builds it (or "prebuilt") and torch, as one short
    hash: what a build in inductor's cache, and Auto's timing of it, belong to."""
    from kvchat.engine import toolchain

    compiler = "prebuilt" if int8_rows.prebuilt() else toolchain.describe().get("compiler", "")
    text = int8_rows.source_text() + compiler + torch.__version__
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _built_marker():
    """A file that says this kernel was built in this cache before (``kernel_identity``), so that a
    build now comes from inductor's disk cache in well under a second."""
    from kvchat.core.paths import cache_dir

    return cache_dir() / "inductor" / f"kvchat-int8-rows-{kernel_identity()}.built"


def kernel_built_before() -> bool:
    """Whether building the kernel now is quick: built in this process, or on this machine before
    (a first build with the bundled clang also builds its C++ library: a minute)."""
    return int8_rows.built or int8_rows.prebuilt() is not None or _built_marker().is_file()


def _build_in_background() -> None:
    # niced as the compile child is: its compiler (which inherits this) shares two cores with a
    # first prefill (a compile started before one made a first token 5.9 s, scheduler.py)
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    try:
        build_kernel()
    except Exception:  # noqa: BLE001 - the compile thread's warm-up tries again
        if not sys.is_finalizing():
            log.exception("building the int8 kernel failed")


def build_kernel_soon(model: nn.Module) -> None:
    """Build the int8 kernel on a thread of its own from a model's load on: with a compile child,
    the compile thread's warm-up comes only once the child's graph is done (minutes on a first
    start), and the eager steps until then ran inductor's product over unpacked copies."""
    if not (int8_rows.built or int8_rows.failed) and any(getattr(m, "packed", False) for m in model.modules()):
        threading.Thread(target=_build_in_background, name="kvchat-int8-kernel", daemon=True).start()
