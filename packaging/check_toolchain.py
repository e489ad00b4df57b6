"""package-check's compile half: the packaged app and the venv, run with the system's compilers and
Python's headers hidden (without_compilers.sh), must compile the decode step (not fall back to
eager), and `kvchat bench decode --json` from both, in the same run, prints side by side.
Standard library only (check.py's helper)."""
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDE = HERE / "without_compilers.sh"
EAGER_NOTICE = "decoding without compilation"
BENCH_ARGS = ["bench", "decode", "--paths", "compiled", "--weights", "auto", "--prompt-len", "128",
              "--new-tokens", "64", "--repeats", "3", "--json"]
BENCH_TIMEOUT = 900  # s: a fresh cache compiles the step (and zig builds its libc++ once)
BAR = 0.85


class CompileCheckFailed(Exception):
    pass


def interpreter_of(app: list[str]) -> str:
    """The Python whose include dir must be hidden: the venv's for a venv's kvchat."""
    beside = Path(app[0]).parent / "python"
    return str(beside) if beside.is_file() else sys.executable


def hidden(app: list[str]) -> list[str]:
    if os.geteuid() != 0:
        raise CompileCheckFailed("hiding the compilers needs root (CI runs as root); run without --hide-compilers")
    return [str(HIDE), "--python", interpreter_of(app)] + app


def verify_hidden(app: list[str]) -> None:
    hidden(app)  # refuses without root
    proc = subprocess.run([str(HIDE), "--python", interpreter_of(app), "--verify"], capture_output=True, text=True,
                          timeout=60)
    if proc.returncode != 0:
        raise CompileCheckFailed(f"the compilers or headers are not hidden: {proc.stderr.strip()}")


def set_up_headers(app: list[str], env: dict) -> None:
    """What `make run`'s set-up does for a venv on a machine without python3-dev: Python's headers
    into kvchat's cache. Here copied from the venv's interpreter before they are hidden (a Debian
    Python would unpack libpythonX.Y-dev instead). The packaged app carries its own."""
    python = Path(app[0]).parent / "python"
    if not python.is_file():
        return
    code = ("import sysconfig; from pathlib import Path; from kvchat.engine import python_headers as h; "
            "h.copy_tree(Path(sysconfig.get_paths()['include']), h.cached_dir())")
    subprocess.run([str(python), "-c", code], env=env, check=True, timeout=120)


def log_says_eager(log: Path) -> str | None:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if EAGER_NOTICE in line:
            return line.strip()
    return None


def bench(app: list[str], env: dict, cwd: Path, log: Path, packaged: bool) -> dict:
    with open(log, "wb") as err:
        try:
            proc = subprocess.run(hidden(app) + BENCH_ARGS, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=err,
                                  timeout=BENCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise CompileCheckFailed(f"bench decode: no result within {BENCH_TIMEOUT} s ({log})") from None
    if proc.returncode != 0:
        raise CompileCheckFailed(f"bench decode exited {proc.returncode} ({log})")
    out = json.loads(proc.stdout)
    notes = [n for n in out.get("notes", []) if EAGER_NOTICE in n]
    if notes or "compiled" not in out.get("paths", {}):
        raise CompileCheckFailed(f"bench decode did not compile the step: {notes or out.get('paths')}")
    products = (out.get("cpu_build") or {}).get("int8_products") or ""
    if "did not build" in products:  # the .cpp left out, or a compile error
        raise CompileCheckFailed(f"bench decode: {products} ({log})")
    if packaged and "int8_rows kernel" in products and "prebuilt" not in products:
        raise CompileCheckFailed(f"bench decode: the packaged app built its kernel instead of loading the "
                                 f"prebuilt one: {products} ({log})")
    return out


VECTOR_ISA_CODE = ("from kvchat.engine import toolchain; toolchain.configure(); "
                   "from torch._inductor import cpu_vec_isa; print(cpu_vec_isa.pick_vec_isa())")


def vector_isa(app: list[str], env: dict) -> str:
    """The vector ISA inductor finds in a packaged app. Its probe runs ``sys.executable -c CODE``,
    which in the app is kvchat itself: when kvchat could not run that, inductor compiled scalar C++
    and the packaged decode ran at 0.44x the venv's."""
    proc = subprocess.run(hidden(app) + ["-c", VECTOR_ISA_CODE], env=env, capture_output=True, text=True,
                          timeout=BENCH_TIMEOUT)
    isa = (proc.stdout.strip().splitlines() or [""])[-1]
    if proc.returncode != 0 or not isa or isa == "INVALID_VEC_ISA":
        raise CompileCheckFailed(f"inductor finds no vector ISA in the app: {isa or proc.stderr.strip()[-300:]}")
    return isa


def compare(apps: dict[str, list[str]], fresh_env, root: Path) -> dict:
    """bench decode from each app, with compilers hidden and fresh dirs, one after the other."""
    results = {}
    for name, app in apps.items():
        env = fresh_env(root / f"bench-{name}")
        set_up_headers(app, env)
        packaged = not (Path(app[0]).parent / "python").is_file()  # a venv runs python
        isa = vector_isa(app, env) if packaged else None
        results[name] = bench(app, env, root / f"bench-{name}" / "home", root / f"bench-{name}.log", packaged)
        results[name]["vector_isa"] = isa or "(python's)"
    return results


def table(results: dict) -> str:
    names = list(results)
    rows = [("", *names)]
    rows.append(("decode tok/s (compiled)", *(f"{results[n]['paths']['compiled']['decode_tok_s']:.1f}" for n in names)))
    rows.append(("prefill tok/s", *(f"{results[n]['paths']['compiled']['prefill_tok_s']:.0f}" for n in names)))
    rows.append(("prepare (compile) s", *(str(results[n].get("prepare_s", {}).get("compiled", "?")) for n in names)))
    rows.append(("inductor's vector ISA", *(results[n].get("vector_isa", "?") for n in names)))
    rows.append(("weight bytes", *(f"{results[n]['weight_bytes'] / 1e6:.0f} MB" for n in names)))
    rows.append(("products", *((results[n].get("cpu_build") or {}).get("int8_products") or "?" for n in names)))
    rows.append(("OpenMP", *((results[n].get("cpu_build") or {}).get("openmp") or "?" for n in names)))
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["    " + "  ".join(c.ljust(w) for c, w in zip(r, width)) for r in rows]
    if len(names) == 2:
        a, b = (results[n]["paths"]["compiled"]["decode_tok_s"] for n in names)
        ratio = a / b
        lines.append(f"    {names[0]} / {names[1]} decode: {ratio:.2f}x (bar {BAR}x: "
                     f"{'met' if ratio >= BAR else 'NOT met'})")
    return "\n".join(lines)
