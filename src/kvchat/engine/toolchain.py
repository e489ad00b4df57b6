"""The C/C++ compiler that inductor (the CPU's compiled decode step) and Triton (its launchers on
CUDA) build with.

The system's g++/gcc when the machine has one and Python's headers are where the interpreter says;
otherwise the toolchain that travels with kvchat: zig's clang (the ``ziglang`` wheel: a compiler,
linker, libc++ and glibc's headers in one binary), LLVM's OpenMP runtime (``cmeel-libomp``: clang's
OpenMP code calls ``__kmpc_*``, which torch's own libgomp lacks; without OpenMP the int8 step
decodes at 0.69x), and Python's headers (python_headers.py). Two shell wrappers in kvchat's cache
dir turn them into one ``clang``/``clang++`` path each, which is what inductor's config and
Triton's ``CC`` take: a single executable, named so that inductor passes clang's flags.
"""
import ctypes
import functools
import hashlib
import importlib.util
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from kvchat.core.paths import cache_dir
from kvchat.engine import python_headers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Toolchain:
    cc: str
    cxx: str
    bundled: bool  # kvchat's own (zig), not the system's
    python_include: Path
    libomp: Path | None = None


def _package_dir(name: str) -> Path | None:
    """An installed package's folder; in a packaged app, the folder PyInstaller put its data in."""
    if getattr(sys, "frozen", False):
        path = Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)) / name
        if path.is_dir():
            return path
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def zig_binary() -> Path | None:
    folder = _package_dir("ziglang")
    binary = folder / "zig" if folder else None
    return binary if binary and os.access(binary, os.X_OK) else None


def libomp_prefix() -> Path | None:
    """cmeel-libomp installs a prefix (lib/libomp.so, include/omp.h) beside the site-packages'
    modules, not as a package; the packaged app carries it under the same name."""
    roots = [Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent))] if getattr(sys, "frozen", False) else []
    roots += [Path(p) for p in sys.path if p]
    for root in roots:
        prefix = root / "cmeel.prefix"
        if (prefix / "lib" / "libomp.so").is_file() and (prefix / "include" / "omp.h").is_file():
            return prefix
    return None


def system_compiler() -> tuple[str, str] | None:
    cxx = shutil.which("g++") or shutil.which("c++")
    cc = shutil.which("gcc") or shutil.which("cc")
    return (cc, cxx) if cc and cxx else None


def _write(path: Path, text: str) -> None:
    if path.is_file() and path.read_text() == text:
        return
    staging = path.with_name(path.name + f".{os.getpid()}")
    staging.write_text(text)
    staging.chmod(0o755)
    staging.replace(path)  # atomic: another kvchat process may be running this wrapper


def _wrappers(zig: Path, omp: Path, include: Path) -> tuple[str, str]:
    """clang/clang++ scripts that run zig with OpenMP's and Python's headers, libomp to link
    (inductor asks clang for -lgomp: a libgomp.so link to libomp answers it), and zig's cache in
    kvchat's. Keyed by the paths they name, so a moved app writes new ones."""
    key = hashlib.sha256(f"{zig}|{omp}|{include}".encode()).hexdigest()[:12]
    folder = cache_dir() / "toolchain" / key
    (folder / "lib").mkdir(parents=True, exist_ok=True)
    link = folder / "lib" / "libgomp.so"
    if not link.is_symlink() or os.readlink(link) != str(omp / "lib" / "libomp.so"):
        link.unlink(missing_ok=True)
        link.symlink_to(omp / "lib" / "libomp.so")
    zig_cache = cache_dir() / "zig"
    # inductor keys its precompiled header by the command line, the header's preprocessed text
    # and the compiler's version, not by file times; clang refused one whose header's mtime changed
    # (torch reinstalled, a new venv at the same path) and every compile failed. That key covers
    # what clang's own checks would; its folder is named after the files (own_precompiled_headers).
    flags = " ".join(shlex.quote(f) for f in [
        "-Xclang", "-fno-validate-pch", "-isystem", str(omp / "include"), "-isystem", str(include), f"-L{folder / 'lib'}",
        f"-Wl,-rpath,{omp / 'lib'}"])
    for name, mode in (("clang", "cc"), ("clang++", "c++")):
        _write(folder / name, "#!/bin/sh\n# written by kvchat (engine/toolchain.py): zig's clang with OpenMP and "
               "Python's headers\n"
               f"ZIG_GLOBAL_CACHE_DIR=${{ZIG_GLOBAL_CACHE_DIR:-{shlex.quote(str(zig_cache))}}}\n"
               "export ZIG_GLOBAL_CACHE_DIR\n"
               f'exec {shlex.quote(str(zig))} {mode} {flags} "$@"\n')
    return str(folder / "clang"), str(folder / "clang++")


def _with_headers(compiler: str, include: Path, name: str) -> str:
    """The system's compiler, told where the headers kvchat found are (they are not where the
    interpreter says, or the system's compiler would be used as it is)."""
    folder = cache_dir() / "toolchain" / hashlib.sha256(f"{compiler}|{include}".encode()).hexdigest()[:12]
    folder.mkdir(parents=True, exist_ok=True)
    _write(folder / name, "#!/bin/sh\n# written by kvchat (engine/toolchain.py)\n"
           f'exec {shlex.quote(compiler)} -isystem {shlex.quote(str(include))} "$@"\n')
    return str(folder / name)


def _bundled_wanted(include: Path | None) -> bool:
    """find()'s choice of the bundled clang, before anything is written: no system compiler, or
    Python's headers are not the interpreter's own (a packaged app's)."""
    if include is None or not (zig_binary() and libomp_prefix()):
        return False
    return system_compiler() is None or include != Path(python_headers.candidates()[0])


def find() -> tuple[Toolchain | None, str | None]:
    """The toolchain to compile with, or None and why there is none."""
    include = python_headers.find()
    if include is None:
        return None, "decoding without compilation: Python's headers (Python.h) are missing"
    system = system_compiler()
    if system and not _bundled_wanted(include):
        if include == Path(python_headers.candidates()[0]):
            return Toolchain(system[0], system[1], False, include), None
        return Toolchain(_with_headers(system[0], include, "gcc"), _with_headers(system[1], include, "g++"),
                         False, include), None
    zig, omp = zig_binary(), libomp_prefix()
    if zig and omp:
        cc, cxx = _wrappers(zig, omp, include)
        return Toolchain(cc, cxx, True, include, omp / "lib" / "libomp.so"), None
    return None, "decoding without compilation: no C++ compiler (g++) found, and no bundled one (ziglang)"


SPINCOUNT = "1000"  # GOMP_SPINCOUNT beside LLVM's OpenMP: libgomp's default is 300000


def quiet_torch_openmp() -> bool:
    """Where the bundled clang will build the compiled step, its code and the int8 kernel run on
    LLVM's libomp while torch's own operators run on its libgomp: two pools of threads on the same
    cores, each spinning after its regions while the other's run. With libgomp's threads sleeping
    at once, the bundled build's prefill of 512 tokens went from 294-361 to 693-714 tok/s and its
    decode from 56-74 to 71-77 tok/s (AVX-512, 2 cores; g++: 955-1201 and 72-74). libgomp reads
    this once, as torch loads it: call before torch is imported. A user's own setting is kept."""
    if "GOMP_SPINCOUNT" in os.environ or "OMP_WAIT_POLICY" in os.environ:
        return False
    if not _bundled_wanted(python_headers.find()):
        return False
    os.environ["GOMP_SPINCOUNT"] = SPINCOUNT
    return True


def own_precompiled_headers(chain: Toolchain) -> Path:
    """Inductor's precompiled header in kvchat's cache, in a folder named after the files it is
    built from (returned). Inductor keeps it in one folder under /tmp for the whole machine, keyed
    by the header's text, the flags and the compiler's version: a kvchat installed again at the
    same path (new files, the same text: a new venv, an updated app) found the old one, and clang
    read the headers again beside it ("redefinition of 'capacity_in_bytes'"), so every compile
    failed. The files' identities (inode, mtime) name the folder here: new files, a new header."""
    import torch
    from torch._inductor import codecache

    compiler = zig_binary() if chain.bundled else Path(shutil.which("g++") or chain.cxx)
    built_from = [Path(torch.__file__).parent / "include" / "torch" / "csrc" / "inductor" / "cpp_prefix.h",
                  chain.python_include / "Python.h", compiler]
    if chain.libomp is not None:  # cpp_prefix.h includes omp.h: the bundled chain's is LLVM's
        built_from.append(chain.libomp.parent.parent / "include" / "omp.h")
    names = []
    for path in built_from:
        try:
            st = Path(path).stat()
            names.append(f"{path}:{st.st_dev}:{st.st_ino}:{st.st_mtime_ns}:{st.st_size}")
        except (OSError, TypeError):
            names.append(f"{path}:missing")
    folder = cache_dir() / "inductor-headers" / hashlib.sha256("|".join(names).encode()).hexdigest()[:16]
    codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR = str(folder), str(folder / "locks")
    _prune_headers(folder)
    return folder


HEADERS_KEPT_S = 14 * 86400


def _prune_headers(current: Path) -> None:
    """Marks ``current`` as used now and removes the folders no install has used for two weeks
    (35 MB each with zig's clang, 150 MB with g++; every reinstall leaves one). Not at once: two
    installs may share this cache, and the other one may be compiling with its header now."""
    try:
        if not current.is_dir():
            current.mkdir(parents=True)
            # made again after another install pruned it: inductor's cached path to a header
            # there is gone with it
            from torch._inductor import codecache

            made = getattr(codecache, "_precompile_header", None)
            if hasattr(made, "cache_clear"):
                made.cache_clear()
        os.utime(current)
    except OSError:  # pruned by another install just now: inductor makes it again
        return
    now = time.time()
    for folder in current.parent.iterdir():
        try:
            if folder != current and folder.is_dir() and now - folder.stat().st_mtime > HEADERS_KEPT_S:
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def launcher_builder(cc: str):
    """Triton's ``knobs.build.impl``: its launcher's C file compiled by ``cc`` (our wrapper, which
    knows where Python's headers are), as Triton's own build would with a system compiler."""
    import sysconfig

    def build(name, src, srcdir, library_dirs, include_dirs, libraries):
        import subprocess

        so = os.path.join(srcdir, f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}")
        cmd = [cc, src, "-O3", "-shared", "-fPIC", "-o", so, f"-I{srcdir}"]
        cmd += [f"-I{d}" for d in include_dirs if d]
        cmd += [f"-L{d}" for d in library_dirs] + [f"-Wl,-rpath,{d}" for d in library_dirs]
        cmd += [f"-l:{lib}" if ".so" in lib else f"-l{lib}" for lib in libraries]
        subprocess.check_call(cmd, stdout=subprocess.DEVNULL)
        return so

    return build


@functools.cache
def configure() -> tuple[Toolchain | None, str | None]:
    """Finds the toolchain once a process and points inductor (and Triton, where it is installed)
    at it. Returns find()'s answer."""
    chain, why = find()
    if chain is None or not (chain.bundled or chain.cxx.startswith(str(cache_dir()))):
        return chain, why  # the system's compiler, found by inductor and Triton themselves
    if chain.libomp is not None:
        # compiled kernels name libomp.so; loaded here, a kernel cached by an app since moved
        # still finds it (a loaded library answers for its soname)
        try:
            ctypes.CDLL(str(chain.libomp))
        except OSError as e:
            return None, f"decoding without compilation: LLVM's OpenMP runtime does not load ({e})"
    os.environ["CXX"], os.environ["CC"] = chain.cxx, chain.cc  # read by inductor's subprocesses
    # inductor still names the interpreter's include dir (absent here) and warns at every build;
    # the wrapper passes the headers kvchat found
    warnings.filterwarnings("ignore", message="Can't find Python.h")
    from torch._inductor import config

    # torch's config overrides are context variables: set here, a compile on another thread (the
    # engine compiles on its own) would still see the default g++. The default is what every
    # thread reads when nothing overrides it.
    entry = getattr(config, "_config", {}).get("cpp.cxx")
    if entry is not None and hasattr(entry, "default"):
        entry.default = (chain.cxx,)
    config.cpp.cxx = (chain.cxx,)
    if importlib.util.find_spec("triton") is not None:
        try:
            from triton import knobs

            knobs.build.impl = launcher_builder(chain.cc)
        except (ImportError, AttributeError) as e:  # a Triton before knobs reads CC, set above
            log.info("Triton's build.impl not set (%s); it uses CC", e)
    log.info("compiling with kvchat's own toolchain: %s", chain.cxx)
    return chain, None


@functools.cache
def describe() -> dict:
    """The compiler and OpenMP runtime that build the compiled step and the CPU kernels here, for
    a bench's report (what a speed figure depends on beside the ISA)."""
    chain, why = configure()
    if chain is None:
        return {"compiler": "none", "openmp": "none", "why": why}
    try:
        run = subprocess.run([chain.cxx, "--version"], capture_output=True, text=True, timeout=30)
        version = (run.stdout.splitlines() or ["?"])[0].strip()
    except (OSError, subprocess.SubprocessError) as e:
        version = f"? ({e})"
    origin = "bundled zig clang" if chain.bundled else "the system's"
    openmp = "LLVM libomp" if chain.libomp else "GNU libgomp"
    if chain.libomp and "GOMP_SPINCOUNT" in os.environ:
        openmp += f" (torch's libgomp: GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']})"
    return {"compiler": f"{version} ({origin})", "openmp": openmp}
