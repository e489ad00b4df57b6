"""What ``make gpu-check`` relies on, checked on the CPU: a borrowed GPU gives minutes, and a
result lost or false there is not known until the next loan."""
import ast
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
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


# Code the GPU machine never runs (no display, no network, no model file: random weights only), so
# neither do its imports: a module and those below it, or module:function for one function.
ELSEWHERE = {
    "kvchat.app": "the GUI",
    "kvchat.bench.ui": "the GUI's timings",
    "kvchat.bench.api": "a server and its clients",
    "kvchat.cli.main:cmd_serve": "kvchat serve",
    "kvchat.remote": "a server elsewhere",
    "kvchat.core.connections": "saved connections and their keys",
    "kvchat.core.model_library": "the headers of .gguf files",
    "kvchat.engine.model.gguf": "a .gguf file",
}
ON_THE_GPU_MACHINE = ("torch", "transformers", "triton")  # with their dependencies


def third_party_imports() -> dict[str, set[str]]:
    """The top-level names that kvchat.cli.main and the benches import, at the top of a module or
    in a function (a bench's imports run when it does), each with the modules importing it."""
    src = ROOT / "src"

    def path(module: str) -> Path:
        p = src.joinpath(*module.split("."))
        return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")

    def away(where: str) -> bool:
        return any(where == e or where.startswith((e + ".", e + ":")) for e in ELSEWHERE)

    todo = ["kvchat.cli.main", *(f"kvchat.bench.{p.stem}" for p in (src / "kvchat" / "bench").glob("*.py"))]
    seen, found = set(), {}
    while todo:
        module = todo.pop()
        if module in seen or away(module) or not path(module).exists():  # kvchat.x.name: not a module
            continue
        seen.add(module)
        todo += [module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)]  # its packages run first
        for top in ast.parse(path(module).read_text()).body:
            function = isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and away(f"{module}:{top.name}"):
                continue
            for node in ast.walk(top):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    assert not node.level, f"{module}: a relative import"
                    names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] == "kvchat":
                        todo.append(name)
                    elif name.split(".")[0] not in sys.stdlib_module_names:
                        found.setdefault(name.split(".")[0], set()).add(module)
    return found


def needed_distributions(roots) -> set[str]:
    """``roots`` and everything they require as installed here, extras left out."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    seen, todo = set(), list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            wanted = [Requirement(r) for r in requires(name) or []]
        except PackageNotFoundError:
            continue
        todo += [r.name for r in wanted if r.marker is None or r.marker.evaluate({"extra": ""})]
    return seen


def test_gpu_wheels_carry_every_import_the_check_reaches_beyond_torch_transformers_and_triton():
    """The GPU machine has torch, Triton and transformers; whatever else kvchat.cli.main and the
    benches import comes from .whl/ (make gpu-wheels, installed there with --no-deps), or every
    step dies on its first import (psutil and platformdirs were missing). Pinned as installed here."""
    from importlib.metadata import packages_distributions, requires, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    line = re.search(r"^GPU_WHEELS \?= (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    wheels = dict(w.split("==") for w in line.split())
    there = needed_distributions(ON_THE_GPU_MACHINE)
    carried = {canonicalize_name(w) for w in wheels}
    provided = {m: {canonicalize_name(d) for d in ds} for m, ds in packages_distributions().items()}
    imports = third_party_imports()
    assert {"torch", "psutil", "platformdirs"} <= imports.keys()  # the walk finds what it must
    missing = {m: sorted(by) for m, by in imports.items() if not provided.get(m, set()) & (there | carried)}
    assert not missing, f"imported, neither on the GPU machine nor in GPU_WHEELS: {missing}"
    for wheel, pinned in wheels.items():
        assert version(wheel) == pinned, wheel
        wanted = [Requirement(r) for r in requires(wheel) or []]
        unmet = {canonicalize_name(r.name) for r in wanted
                 if r.marker is None or r.marker.evaluate({"extra": ""})} - there - carried
        assert not unmet, f"{wheel} needs {unmet}, which --no-deps leaves behind"


def test_each_call_of_the_check_fits_8_minutes_and_together_they_run_every_step():
    """A device command may run 10 minutes, start-up included: the check is two calls whose step
    limits sum to at most 8 minutes each (one call's 1,200 s could not finish), and the steps the
    script runs are exactly those of call 1 then call 2, in their order."""
    script = (ROOT / "tools" / "gpu_check.sh").read_text()
    found = [re.search(rf'^CALL_{n}="([^"]*)"$', script, re.M) for n in (1, 2)]
    assert all(found), "gpu_check.sh names no CALL_1 and CALL_2"
    calls = [f.group(1).split() for f in found]
    steps = [[entry.split(":")[0] for entry in call] for call in calls]
    for call in calls:
        assert sum(int(entry.split(":")[1]) for entry in call) <= 8 * 60, call
    assert re.findall(r"^(?:step|kv) (\w+)", script, re.M) == steps[0] + steps[1]


def test_the_kernel_step_files_each_tests_outcome_as_it_ends(tmp_path):
    """A pytest killed by the step's limit writes no JUnit XML: the plugin files each outcome the
    moment it is known, as this second test sees of the first while it runs."""
    figures = tmp_path / "results.jsonl"
    (tmp_path / "test_two.py").write_text(f'''
import json, pytest

def test_first():
    pass

def test_second():
    lines = [json.loads(line)["figure"] for line in open({str(figures)!r})]
    assert [(f["test"], f["outcome"]) for f in lines] == [("test_two.py::test_first", "passed")]

@pytest.mark.skip
def test_third():
    pass
''')
    env = {**os.environ, "KVCHAT_FIGURES": str(figures), "KVCHAT_STEP": "kernel_tests",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                           "-p", "tools.gpu_check_tests", "test_two.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    lines = [json.loads(line) for line in figures.read_text().splitlines()]
    assert [(x["step"], x["figure"]["test"], x["figure"]["outcome"]) for x in lines] == [
        ("kernel_tests", "test_two.py::test_first", "passed"), ("kernel_tests", "test_two.py::test_second", "passed"),
        ("kernel_tests", "test_two.py::test_third", "skipped")]


SPECIALISATION_BAR = 60  # seconds each on the GPU, serial, within the kernel step's 240 s


@pytest.mark.slow
def test_the_gpu_kernel_step_compiles_at_most_60_specialisations_and_runs_every_engine_variant(tmp_path):
    """The kernel step's tests (tools/gpu_kernel_tests.txt), run here under the interpreter with
    every launch bound as Triton binds it for sm_90 (tools/triton_specialisations.py): the distinct
    specialisations are what the step would compile, and their variants must be every one that the
    engine runs on the 8B shape (compile_check's matrix)."""
    from kvchat.kernels import compile_check

    listed = [line for line in (ROOT / "tools" / "gpu_kernel_tests.txt").read_text().splitlines()
              if line and not line.startswith("#")]
    assert "gpu_kernel_tests.txt" in (ROOT / "tools" / "gpu_check.sh").read_text()
    out = tmp_path / "specialisations.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "KVCHAT_SPECIALISATIONS": str(out)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", "-p",
                           "tools.triton_specialisations", *listed], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:]
    launches = json.loads(out.read_text())
    assert set(launches) == set(listed)  # each listed test ran and launched kernels
    keys = {(kernel, key) for per_test in launches.values() for kernel, key, _ in per_test}
    assert 20 <= len(keys) <= SPECIALISATION_BAR, len(keys)
    ran = set()
    for per_test in launches.values():
        for kernel, _, named in per_test:
            consts = json.loads(named)
            ran.add(compile_check.variant_class(kernel, consts, bool(consts.get("FP8", 0))))
    _, heads, kv_heads, head_dim = compile_check.SHAPES[0]
    engine = {compile_check.variant_class(v.kernel, v.constexprs, v.fp8)
              for v in compile_check.all_variants(heads, kv_heads, head_dim)}
    assert engine - ran == set()
