"""What ``make gpu-check`` relies on, checked on the CPU: a borrowed GPU gives minutes, and a
result lost or false there is not known until the next loan."""
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_without_cuda_or_the_interpreter_every_gpu_test_is_skipped(tmp_path):
    """With TRITON_INTERPRET=0 Triton compiles for a GPU, whose kernels take CUDA pointers: a ``gpu``
    test that ran there on CPU tensors (test_cuda_path's did) would fail with the kernels fine. So
    with no CUDA device every one of them must skip, each file's (conftest's rule; with a device,
    their DEVICE is cuda)."""
    marked = re.compile(r"\bpytest\.mark\.gpu\b")
    files = sorted(p for p in (ROOT / "tests").rglob("test_*.py") if marked.search(p.read_text()))
    report = tmp_path / "gpu.xml"
    env = {**os.environ, "TRITON_INTERPRET": "0", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-m", "gpu",
                           f"--junitxml={report}", *map(str, files)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    ran = [f"{c.get('classname')}::{c.get('name')}" for c in cases if c.find("skipped") is None]
    assert not ran, ran
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in files}
    assert {m for m in modules if any(c.get("classname").startswith(m) for c in cases)} == modules
