"""The layout's rules (DESIGN.md), read from the source: which layer may import which, no import
circle, no file or class too big to read. Every import counts, those inside functions too: a lazy
import is still a dependency."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
LAYERS = ("core", "engine", "kernels", "remote", "serve", "cli", "bench", "app")
HEAVY = ("torch", "triton", "transformers", "safetensors", "bitsandbytes", "accelerate")
QT_HTTP = ("PySide6", "fastapi", "starlette", "uvicorn", "httpx", "sse_starlette", "httpx_sse")
MAX_FILE_LINES = 400
MAX_CLASS_LINES = 250


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file; ``from a import b`` gives ``a`` and,
    when ``a.b`` is a module of ours, ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; kvchat's imports are absolute"
            found.append((node.module, node.lineno))
            found += [(f"{node.module}.{a.name}", node.lineno) for a in node.names
                      if f"{node.module}.{a.name}" in MODULES]
    return found


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "kvchat" and len(parts) > 1 else None


def top(module: str) -> str:
    return module.split(".")[0]


def broken_rule(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported``, or None."""
    mine, theirs = layer(importer), layer(imported)
    if mine == "core":
        if top(imported) in HEAVY + QT_HTTP:
            return "core imports no torch, Qt or HTTP"
        if theirs not in (None, "core"):
            return "core imports only core"
        if importer == "kvchat.core.kv_format" and theirs is not None:
            return "the KV layout's sizes import nothing of kvchat (the kernels read them)"
    if mine == "kernels" and theirs not in (None, "kernels") and imported != "kvchat.core.kv_format":
        return "kernels import nothing of kvchat but the KV layout's sizes (core/kv_format.py)"
    if mine == "engine" and (top(imported) in QT_HTTP or theirs in ("app", "remote", "serve", "cli", "bench")):
        return "the engine imports no Qt, no HTTP, and no layer above it"
    if mine == "app" and (theirs in ("engine", "kernels", "serve", "cli", "bench") or top(imported) in HEAVY):
        return "the app imports core and remote, never the engine (the kvchat command hands it the engine's maker)"
    if mine == "remote" and theirs in ("engine", "kernels", "app", "serve", "cli", "bench"):
        return "remote imports only core"
    if mine == "serve" and theirs in ("app", "cli", "bench", "remote"):
        return "serve sits below the command line"
    return None


def test_every_module_is_in_a_layer():
    assert {layer(m) for m in MODULES} - {None} == set(LAYERS)


def test_each_layer_imports_only_what_it_may():
    broken = [f"{MODULES[m].relative_to(SRC)}:{line} imports {imported}: {why}"
              for m in MODULES for imported, line in imports(MODULES[m])
              if (why := broken_rule(m, imported))]
    assert broken == []


def test_the_rules_catch_what_they_forbid():
    """The checker itself, on imports the layout forbids."""
    assert broken_rule("kvchat.core.memory", "torch")
    assert broken_rule("kvchat.core.memory", "kvchat.engine.kv.cache")
    assert broken_rule("kvchat.core.memory", "kvchat.kernels.quant")
    assert broken_rule("kvchat.app.main", "kvchat.engine.engine")
    assert broken_rule("kvchat.kernels.quant", "kvchat.core.config")
    assert broken_rule("kvchat.engine.engine", "PySide6.QtCore")
    assert broken_rule("kvchat.engine.engine", "kvchat.serve.server")
    assert broken_rule("kvchat.core.kv_format", "torch")
    assert broken_rule("kvchat.core.kv_format", "kvchat.core.config")
    assert broken_rule("kvchat.kernels.quant", "kvchat.core.kv_format") is None
    assert broken_rule("kvchat.core.memory", "kvchat.core.kv_format") is None
    assert broken_rule("kvchat.app.views.main_window", "kvchat.remote.client") is None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    graph = {m: {i for i, _ in imports(p) if i in MODULES and i != m} for m, p in MODULES.items()}
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_file_or_class_too_big_to_read():
    too_big = []
    for m, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > MAX_FILE_LINES:
            too_big.append(f"{path.relative_to(SRC)}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_big.append(f"{path.relative_to(SRC)}: class {node.name}, {node.end_lineno - node.lineno + 1} lines")
    assert too_big == []


@pytest.mark.parametrize("layer_name", ["core", "remote"])
def test_the_torch_free_layers_load_no_torch(layer_name):
    """Importing every module of the layer, as the app does while its window opens."""
    names = [m for m in MODULES if layer(m) == layer_name]
    code = (f"import sys\nfor m in {names!r}: __import__(m)\n"
            f"print(sorted(h for h in {HEAVY!r} if h in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def engine_holders(text: str) -> list[str]:
    """Where a class other than the Engine keeps the engine: a weak proxy, or an ``engine``
    argument stored on ``self``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "proxy" and getattr(node.value, "id", "") == "weakref":
            found.append(f"line {node.lineno}: weakref.proxy")
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id == "engine":
            found += [f"line {node.lineno}: self.{t.attr} = engine" for t in node.targets
                      if isinstance(t, ast.Attribute) and getattr(t.value, "id", "") == "self"]
    return found


def test_no_part_of_the_engine_holds_the_engine():
    """Issue 51 step 1: the parts take the session they work on and an outbox to speak through.
    Five parts held the engine through a weak proxy and reached through it (188 times)."""
    held = [f"{path.relative_to(SRC)}: {where}" for name, path in MODULES.items() if name.startswith("kvchat.engine")
            for where in engine_holders(path.read_text())]
    assert held == []
    caught = engine_holders("import weakref\nclass Host:\n    def __init__(self, engine):\n"
                            "        self.engine = engine\n        self.e = weakref.proxy(engine)\n")
    assert sorted(caught) == ["line 4: self.engine = engine", "line 5: weakref.proxy"]
