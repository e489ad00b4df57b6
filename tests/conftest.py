import gc
import os
import re
import sys
import shutil
import tempfile
import threading
import time
from pathlib import Path

# Before anything imports torch, transformers, triton or Qt.
os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels run on the CPU, checked against the reference
os.environ.setdefault("KVCHAT_DECODE", "eager")  # tests of the compiled step ask for it by name
if os.environ.get("PYTEST_XDIST_WORKER"):  # one worker a core: torch's OpenMP threads spin, two a worker starve
    os.environ.setdefault("OMP_NUM_THREADS", "1")
# a fresh home per run, removed at the end (chats, personas' KV, settings), whose converted models and
# inductor's compiled code live in a cache that outlives the run: a second run neither converts nor
# compiles. Keyed by the versions that shape them; KVCHAT_TEST_CACHE moves it, KVCHAT_TEST_HOME
# replaces the whole home.
_OWN_HOME = None if os.environ.get("KVCHAT_TEST_HOME") else tempfile.mkdtemp(prefix="kvchat-test-")
os.environ["KVCHAT_HOME"] = os.environ.get("KVCHAT_TEST_HOME") or _OWN_HOME


TEST_CACHE = Path(os.environ.get("KVCHAT_TEST_CACHE") or Path(__file__).resolve().parents[1] / ".test-cache")
# Triton's compiled kernels (the GPU targets' compile check): its cache is keyed by each kernel's
# source, options and Triton's version, so it needs no key of ours
os.environ.setdefault("KVCHAT_TEST_TRITON_CACHE", str(TEST_CACHE / "triton"))


def _keep_built_files(home: Path) -> Path:
    """Keyed by torch's and transformers' versions and by the code that converts and compiles, so
    a change to it is exercised, not served from an older run (kvchat's own version stays 0.1.0,
    and on the GPU machine kvchat runs from the source tree with no metadata at all)."""
    import hashlib
    from importlib.metadata import version

    src = Path(__file__).resolve().parents[1] / "src" / "kvchat" / "engine"
    code = hashlib.sha1(b"".join(p.read_bytes() for p in sorted(src.rglob("*.py")))).hexdigest()[:12]
    key = "-".join([version("torch"), version("transformers"), code])
    kept = TEST_CACHE / key
    os.environ["KVCHAT_TEST_KEPT"] = str(kept)  # for tests that keep compiled code of their own
    for name in ("converted", "inductor"):
        (kept / name).mkdir(parents=True, exist_ok=True)
        (home / "cache").mkdir(parents=True, exist_ok=True)
        (home / "cache" / name).symlink_to(kept / name, target_is_directory=True)
    os.utime(kept)  # in use: a run with another key (the engine's code edited meanwhile) leaves it
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # each engine change left 0.5 GB behind: 8 GB in a month
        for old in TEST_CACHE.glob("*-*-*"):
            if old != kept and re.fullmatch(r"\d[^-]*-\d[^-]*-[0-9a-f]{12}", old.name) and \
                    (old / "converted").is_dir() and time.time() - old.stat().st_mtime > 3600:
                shutil.rmtree(old, ignore_errors=True)
    return kept


if _OWN_HOME:
    _keep_built_files(Path(_OWN_HOME))

import pytest  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "engine"))  # tiny_models and the other helpers there


# what makes a test slow: the starter loaded (5-10 s a worker, then a model's forward passes), or a
# kvchat serve process started; a test using none of them runs in about a second at most
SLOW_FIXTURES = {"starter", "served", "server"}


def pytest_collection_modifyitems(config, items):
    _mark_slow(items)
    _gpu_on_cuda_only(items)


def _mark_slow(items) -> None:
    """``-m "not slow"`` is the inner loop: every test that loads a real model, starts a server or
    interprets a Triton kernel is marked here (the time spreads over hundreds of 2-15 s model tests: marking only the few over
    20 s left a ten-minute tier), the others by hand where they compile or run long."""
    for item in items:
        if item.get_closest_marker("slow"):
            continue
        # a gpu test on the CPU runs its kernels in Triton's interpreter: 1-4 s each
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.slow)


def _gpu_on_cuda_only(items) -> None:
    """A ``gpu`` test hands its tensors to Triton, which compiles for a GPU unless TRITON_INTERPRET=1:
    CPU tensors would reach a compiled kernel as CUDA pointers, a FAILED that says nothing about the
    kernels. So with the interpreter off a ``gpu`` test runs on CUDA tensors (its module's DEVICE),
    and where there is no CUDA device it is skipped (tests/test_gpu_check.py runs them so)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="TRITON_INTERPRET is off and there is no CUDA device")
        for item in gpu:
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_HOME:
        shutil.rmtree(_OWN_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def starter():
    """The starter model, loaded once (converted once per test session into KVCHAT_HOME)."""
    from kvchat.engine.model.loading import load

    return load("starter")


@pytest.fixture(scope="session")
def tokenizer(starter):
    return starter.tokenizer


@pytest.fixture(scope="session")
def engine_model(starter):
    """One copy of the starter for the suite's engines: an engine sets its model's attention to
    kvchat's and keeps its decode step on it, and a copy a test makes for itself costs 540 MB."""
    from tiny_models import as_loaded

    return as_loaded(starter.model, starter.tokenizer, "starter")


@pytest.fixture(scope="session")
def short_starter(starter):
    """The starter's first 4 of 30 layers, one copy for the engine-logic tests that share it
    (``tiny_models.first_layers``)."""
    from tiny_models import first_layers

    return first_layers(starter)


@pytest.fixture(autouse=True)
def _no_compile_left_running():
    """A background compile a test started (the int8 weights' twins of an engine it made, a decode
    step's graph) ends before the next test begins: compiling imports modules on its thread, and
    the next test's pytest-qt hook, iterating a dict as they came, failed ("dictionary changed
    size during iteration")."""
    yield
    for thread in threading.enumerate():
        if thread.name in ("kvchat-compile", "kvchat-int8-kernel"):
            thread.join(600)


@pytest.fixture(scope="module", autouse=True)
def _memory_back_after_each_module():
    """What a module's engines and windows held goes back to the system before the next module:
    the suite's peak is that of its largest module, not the sum of them all."""
    from kvchat.engine.host import trim_heap

    yield
    gc.collect()
    trim_heap()
