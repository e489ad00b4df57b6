"""The toolchain that travels with kvchat (engine/toolchain.py), on a machine made to have no
compiler and no Python headers: packaging/without_compilers.sh runs each check in a mount namespace
where gcc, g++, cc, c++ and clang are /dev/null and Python's include dirs are empty. Python's
headers come from the copy kvchat's set-up puts in its cache dir, as `make run` does."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HIDE = REPO / "packaging" / "without_compilers.sh"
# zig builds libc++ and glibc's stubs once (about a minute on two cores): kept across runs
ZIG_CACHE = Path(os.environ.get("KVCHAT_TEST_CACHE") or REPO / ".test-cache") / "zig"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="hiding the compilers needs root (unshare -m and bind mounts)"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="util-linux's unshare is not installed"),
]


def kept(tmp_path: Path, name: str) -> Path:
    """Kept with the suite's compiled code (conftest: keyed by torch, transformers and the engine's
    code; here by the hiding script too), so a second run compiles nothing again. The compiler's
    path is in inductor's key: the home that holds it is kept too."""
    if not os.environ.get("KVCHAT_TEST_KEPT"):
        return tmp_path / name
    return Path(os.environ["KVCHAT_TEST_KEPT"]) / f"toolchain-{hashlib.sha1(HIDE.read_bytes()).hexdigest()[:8]}" / name


@pytest.fixture
def bare_home(tmp_path):
    """A KVCHAT_HOME whose cache holds Python's headers, copied from this interpreter's include dir
    (what python_headers.ensure() leaves there on a machine without python3-dev)."""
    home = kept(tmp_path, "home")
    # copied once, as ensure() does: the same files run after run (the precompiled header's folder
    # is named after them)
    code = ("import sysconfig; from pathlib import Path; from kvchat.engine import python_headers as h; "
            "(h.cached_dir() / 'Python.h').is_file() or "
            "h.copy_tree(Path(sysconfig.get_paths()['include']), h.cached_dir())")
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "KVCHAT_HOME": str(home)}, check=True)
    return home


def run_hidden(script: str, home: Path, tmp_path: Path, inductor: Path | None = None) -> dict:
    """Runs ``script`` with the compilers and headers hidden; it prints one JSON line last."""
    ZIG_CACHE.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KVCHAT_HOME": str(home), "ZIG_GLOBAL_CACHE_DIR": str(ZIG_CACHE),
           "TORCHINDUCTOR_CACHE_DIR": str(inductor or tmp_path / "inductor"), "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    env.pop("CC", None), env.pop("CXX", None)
    proc = subprocess.run([str(HIDE), "--python", sys.executable, sys.executable, "-c", textwrap.dedent(script)],
                          env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_nothing_is_left_to_find():
    """The hiding is real, or the other tests prove nothing."""
    proc = subprocess.run([str(HIDE), "--python", sys.executable, "--verify"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert Path(sysconfig.get_paths()["include"], "Python.h").is_file()  # outside, untouched


def test_without_headers_anywhere_compiling_is_refused(tmp_path):
    """No headers in the cache either: eager decoding, with the reason."""
    out = run_hidden("""
        import json
        from kvchat.engine.compile_env import cpu_compile_missing
        print(json.dumps({"missing": cpu_compile_missing()}))
    """, tmp_path / "empty-home", tmp_path)
    assert "Python.h" in out["missing"]


def test_triton_launcher_builds_with_the_bundled_toolchain(bare_home, tmp_path):
    """Triton's launcher build path (triton.runtime.build, through knobs.build.impl) compiles a C
    extension that includes Python.h, and the module it loads runs."""
    pytest.importorskip("triton")
    out = run_hidden("""
        import json, shutil
        from kvchat.engine import toolchain
        chain, why = toolchain.configure()
        from triton import knobs
        from triton.runtime import build
        src = '''
        #include <Python.h>
        static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(6 * 7); }
        static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
        static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "kvchat_probe", NULL, -1, methods};
        PyMODINIT_FUNC PyInit_kvchat_probe(void) { return PyModule_Create(&mod); }
        '''
        module = build.compile_module_from_src(src, "kvchat_probe")
        print(json.dumps({"why": why, "bundled": chain.bundled, "impl": knobs.build.impl is not None,
                          "gcc": shutil.which("gcc"), "answer": module.answer()}))
    """, bare_home, tmp_path)
    assert out == {"why": None, "bundled": True, "impl": True, "gcc": None, "answer": 42}


LAUNCH = """
    import json, os, sys
    import kvchat.cli.main
    seen = {}
    def cli(argv):  # what the command line finds when it starts: torch not yet loaded
        seen.update(spin=os.environ.get("GOMP_SPINCOUNT"), torch="torch" in sys.modules)
        return 0
    kvchat.cli.main.main = cli
    from kvchat.cli.launcher import main
    main(["generate"])
    print(json.dumps(seen))
"""


def test_torch_openmp_sleeps_where_the_bundled_clang_builds(bare_home, tmp_path, monkeypatch):
    """Beside the bundled clang's LLVM OpenMP, torch's libgomp threads must not spin: set by the
    launcher before torch loads; with the system's g++ (one runtime) nothing is set."""
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert run_hidden(LAUNCH, bare_home, tmp_path) == {"spin": "1000", "torch": False}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(LAUNCH)], capture_output=True, text=True)
    assert json.loads(proc.stdout.splitlines()[-1]) == {"spin": None, "torch": False}, proc.stderr[-2000:]
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")  # a user's own setting stays
    assert run_hidden(LAUNCH, bare_home, tmp_path) == {"spin": "50", "torch": False}


def test_a_precompiled_header_outlives_a_reinstall_that_touched_its_header(bare_home, tmp_path):
    """Inductor keys its precompiled header by the header's text and keeps it in /tmp: a venv made
    again at the same path gives the same text newer file times, and clang refused the header (every
    compile failed, the step stayed eager, until /tmp was emptied)."""
    out = run_hidden(f"""
        import json, os, subprocess
        from kvchat.engine import toolchain
        chain, why = toolchain.configure()
        tmp = {str(tmp_path)!r}
        header, source = os.path.join(tmp, "prefix.h"), os.path.join(tmp, "kernel.cpp")
        open(header, "w").write("inline int answer() {{ return 42; }}\\n")
        open(source, "w").write("int main() {{ return answer(); }}\\n")
        made = subprocess.run([chain.cxx, "-x", "c++-header", header, "-o", header + ".pch"], capture_output=True, text=True)
        stat = os.stat(header)
        os.utime(header, (stat.st_atime + 3600, stat.st_mtime + 3600))
        built = subprocess.run([chain.cxx, "-include", header, "-c", source, "-o", source + ".o"],
                               capture_output=True, text=True)
        print(json.dumps({{"why": why, "bundled": chain.bundled, "made": made.returncode,
                          "built": built.returncode, "stderr": built.stderr[-400:]}}))
    """, bare_home, tmp_path)
    assert (out["why"], out["bundled"], out["made"]) == (None, True, 0)
    assert out["built"] == 0, out["stderr"]


def test_inductor_compiles_with_openmp_and_equals_eager(bare_home, tmp_path):
    """A function inductor parallelizes (a reduction over 4M elements, two threads) compiles, on
    another thread than the one that configured it, with g++ hidden; the result equals eager, and the kernel calls LLVM's OpenMP runtime (so the threads'
    split is the runtime's, not a serial fallback). A second run of the suite loads what the first
    compiled, until torch, the engine's code or the hiding changes."""
    out = run_hidden("""
        import json, glob, os, subprocess
        import torch
        import torch._inductor.config  # already imported when the engine configures (its default read CXX)
        from kvchat.engine.compile_env import cpu_compile_missing, use_own_headers
        from kvchat.engine import toolchain
        why = cpu_compile_missing()
        use_own_headers()  # what every compile of the engine's does first (use_disk_cache)
        torch.set_num_threads(2)
        torch.manual_seed(0)
        x, y = torch.randn(2048, 2048), torch.randn(2048, 2048)
        def f(x, y):
            return (x.sin() * y + 1).sum(-1) + x.cos().amax(0).sum()
        import threading
        result = {}
        # on a thread of its own, as the engine compiles: torch's config overrides do not cross threads
        worker = threading.Thread(target=lambda: result.update(got=torch.compile(f, fullgraph=True)(x, y)))
        worker.start(); worker.join()
        got = result["got"]
        want = f(x, y)
        libs = glob.glob(os.path.join(os.environ["TORCHINDUCTOR_CACHE_DIR"], "**", "*.so"), recursive=True)
        symbols = " ".join(subprocess.run(["nm", "-uD", so], capture_output=True, text=True).stdout for so in libs)
        from torch._inductor import codecache
        print(json.dumps({"why": why, "cxx": toolchain.configure()[0].cxx,
                          "max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                          "kmpc": "__kmpc_fork_call" in symbols, "headers": codecache._HEADER_DIR,
                          "pch": glob.glob(os.path.join(codecache._HEADER_DIR, "*.pch"))}))
    """, bare_home, tmp_path, kept(tmp_path, "inductor"))
    assert out["why"] is None
    # the precompiled header in kvchat's cache (a first run built it there), not /tmp's shared folder
    assert out["headers"].startswith(str(bare_home / "cache" / "inductor-headers")) and out["pch"], out
    assert out["cxx"].startswith(str(bare_home)) and out["cxx"].endswith("clang++")
    assert out["max_diff"] <= 1e-5 * out["scale"] + 1e-4, out
    assert out["kmpc"], "no kernel calls __kmpc_fork_call: compiled without OpenMP"


def headers_chain(tmp_path: Path, monkeypatch):
    """A system toolchain whose Python.h is in ``tmp_path``, with kvchat's cache there too, and
    inductor's header folder put back after the test."""
    from torch._inductor import codecache

    from kvchat.engine import toolchain

    monkeypatch.setattr(codecache, "_HEADER_DIR", codecache._HEADER_DIR)
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", codecache._HEADER_LOCK_DIR)
    monkeypatch.setattr(toolchain, "cache_dir", lambda: tmp_path / "cache")
    include = tmp_path / "include"
    include.mkdir()
    (include / "Python.h").write_text("/* the same text */\n")
    return toolchain.Toolchain("gcc", "g++", False, include)


def test_the_precompiled_headers_folder_is_named_after_the_files_it_is_built_from(tmp_path, monkeypatch):
    """Python.h made again (as a new venv or app at the same path makes it: the same text, a new
    file) names a new folder; the same files name the same one. Inductor's own folder, one under
    /tmp for the machine keyed by the text, gave the new files the old header, and clang failed
    every compile ("redefinition of 'capacity_in_bytes'")."""
    from torch._inductor import codecache

    from kvchat.engine import toolchain

    chain = headers_chain(tmp_path, monkeypatch)
    include = chain.python_include
    first = toolchain.own_precompiled_headers(chain)
    assert toolchain.own_precompiled_headers(chain) == first and first.parent == tmp_path / "cache" / "inductor-headers"
    assert (codecache._HEADER_DIR, codecache._HEADER_LOCK_DIR) == (str(first), str(first / "locks"))
    (include / "Python.h").unlink()
    (include / "Python.h").write_text("/* the same text */\n")
    again = toolchain.own_precompiled_headers(chain)
    assert again != first and codecache._HEADER_DIR == str(again)


def test_headers_folders_no_install_used_for_two_weeks_are_removed(tmp_path, monkeypatch):
    """Every reinstall named a new folder and left the old one (35-150 MB). A folder in use is
    touched at each choice; one untouched for two weeks goes, a younger one stays (another
    install sharing the cache may compile with it now)."""
    from kvchat.engine import toolchain

    chain = headers_chain(tmp_path, monkeypatch)
    current = toolchain.own_precompiled_headers(chain)
    day = 86400
    old, young = current.parent / "old", current.parent / "young"
    for folder, age in ((old, 15 * day), (young, 13 * day), (current, 20 * day)):
        (folder / "locks").mkdir(parents=True, exist_ok=True)
        (folder / "prefix.h.pch").write_bytes(b"pch")
        os.utime(folder, (time.time() - age, time.time() - age))
    assert toolchain.own_precompiled_headers(chain) == current
    assert sorted(p.name for p in current.parent.iterdir()) == sorted([current.name, "young"])
    assert time.time() - current.stat().st_mtime < 60 and (current / "prefix.h.pch").exists()


def test_every_compile_gets_the_headers_folder_even_a_step_compiled_by_name(monkeypatch):
    """``--decode compiled`` never asks what is missing (``cpu_compile_missing``), so nothing had
    configured the toolchain before its compile: ``use_disk_cache``, which every compile calls
    first, does now."""
    from torch._inductor import codecache

    from kvchat.core.paths import cache_dir
    from kvchat.engine import compile_env, toolchain

    monkeypatch.setattr(codecache, "_HEADER_DIR", "/tmp/not-kvchat/precompiled_headers")
    monkeypatch.setattr(codecache, "_HEADER_LOCK_DIR", "/tmp/not-kvchat/precompiled_headers/locks")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.environ.get("TORCHINDUCTOR_CACHE_DIR", ""))
    toolchain.configure.cache_clear()
    compile_env.use_disk_cache()
    assert codecache._HEADER_DIR.startswith(str(cache_dir() / "inductor-headers" / ""))


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_inductor_caches_each_aten_instruction_set_apart(tmp_path, capability):
    """A step compiled with ATen on AVX-512 and loaded again with ``ATEN_CPU_CAPABILITY=avx2`` (the
    ISA override) decoded token 0 for ever: each capability's compiled code lives in its own folder."""
    env = {**os.environ, "KVCHAT_HOME": str(tmp_path)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if capability == "default":
        env.pop("ATEN_CPU_CAPABILITY", None)
    else:
        env["ATEN_CPU_CAPABILITY"] = capability
    code = ("import os, torch; from kvchat.engine.compile_env import use_disk_cache; use_disk_cache(); "
            "print(os.environ['TORCHINDUCTOR_CACHE_DIR'], torch.backends.cpu.get_cpu_capability())")
    folder, running = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                     check=True).stdout.split()
    assert Path(folder) == tmp_path / "cache" / "inductor" / running.lower()
    if capability != "default":
        assert running.lower() == capability
