"""Where Python's C headers are for the Python that runs kvchat: inductor's CPU code and Triton's
launchers both include Python.h. Looked for, in order: the interpreter's own include dir (a
developer's Python, python3-dev), the copy a packaged app carries (taken from the Python PyInstaller
bundled), and the copy kvchat's set-up put in its cache dir (``python -m kvchat.engine.python_headers``,
run by `make run`; from Debian's libpython3.X-dev, fetched without root by apt-get download).
"""
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from kvchat.core.paths import cache_dir

BUNDLED = "python-include"  # the packaged app's folder of headers, beside its modules


def version_dir() -> str:
    return f"python{sys.version_info.major}.{sys.version_info.minor}"


def cached_dir() -> Path:
    return cache_dir() / "toolchain" / "python-include" / version_dir()


def candidates() -> list[Path]:
    found = [Path(sysconfig.get_paths()["include"])]
    if getattr(sys, "frozen", False):
        found.append(Path(getattr(sys, "_MEIPASS", Path(sys.executable).parent)) / BUNDLED / version_dir())
    found.append(cached_dir())
    return found


def find() -> Path | None:
    """The first include dir that has Python.h and pyconfig.h, or None."""
    for path in candidates():
        if (path / "Python.h").is_file() and (path / "pyconfig.h").is_file():
            return path
    return None


def copy_tree(source: Path, target: Path) -> None:
    """Copies headers into ``target`` (replaced as a whole, so that a half-copied dir is never used)."""
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging, symlinks=False)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)


def fetch_debian(target: Path) -> str | None:
    """Debian's headers for this Python, unpacked into ``target`` without installing anything:
    apt-get download needs no root. Returns why not, or None when done. The package's version
    must be the interpreter's (a different patch level's headers are ABI-compatible)."""
    if not (shutil.which("apt-get") and shutil.which("dpkg-deb") and shutil.which("dpkg-architecture")):
        return "not a Debian-like system (apt-get, dpkg-deb)"
    if not sys.base_prefix.startswith("/usr"):
        return f"this Python ({sys.base_prefix}) is not Debian's; its headers do not come from apt"
    package = f"lib{version_dir()}-dev"
    multiarch = subprocess.run(["dpkg-architecture", "-qDEB_HOST_MULTIARCH"], capture_output=True,
                               text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="kvchat-headers-") as tmp:
        got = subprocess.run(["apt-get", "download", "-q", package], cwd=tmp, capture_output=True, text=True)
        debs = list(Path(tmp).glob("*.deb"))
        if got.returncode != 0 or not debs:
            return f"apt-get download {package} failed: {got.stderr.strip()[-300:]}"
        root = Path(tmp) / "root"
        subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(root)], check=True)
        include = root / "usr" / "include" / version_dir()
        if not (include / "Python.h").is_file():
            return f"{package} has no Python.h"
        # Debian keeps pyconfig.h per architecture; Python.h includes it by its bare name
        config = root / "usr" / "include" / multiarch / version_dir() / "pyconfig.h"
        if config.is_file():
            shutil.copy2(config, include / "pyconfig.h")
        copy_tree(include, target)
    return None


def ensure() -> tuple[Path | None, str]:
    """Python's headers for this interpreter, copied into kvchat's cache when only a system
    package has them. Returns (the dir or None, what happened)."""
    found = find()
    if found is not None:
        return found, f"Python's headers: {found}"
    why = fetch_debian(cached_dir())
    if why is None and find() is not None:
        return find(), f"Python's headers unpacked from Debian's package into {cached_dir()}"
    return None, f"no Python headers for {version_dir()} ({why})"


def main() -> int:
    path, said = ensure()
    print(f"kvchat: {said}", file=sys.stderr)
    if path is None and os.environ.get("KVCHAT_HEADERS_REQUIRED") == "1":
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
