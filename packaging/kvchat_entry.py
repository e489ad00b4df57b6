"""Entry point of the packaged app (PyInstaller needs a script).

In the app, ``sys.executable`` is this program, not a Python. Torch starts it twice as if it were:
- inductor checks that vectorized C++ loads by running ``sys.executable -c CODE`` (cpu_vec_isa.py).
  The app answered with a usage error, so inductor compiled scalar code: the packaged decode ran
  at 0.44x the venv's. Code after ``-c`` is run here as Python would run it.
- inductor's pool of compile workers runs ``sys.executable .../compile_worker/__main__.py``, a
  source file the app does not carry. One compile thread (no pool) keeps that from starting.
"""
import os
import sys

if len(sys.argv) >= 3 and sys.argv[1] == "-c":
    code, sys.argv = sys.argv[2], ["-c", *sys.argv[3:]]
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    sys.exit(0)

os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

from kvchat.cli.launcher import main  # noqa: E402  (after the environment is set)

sys.exit(main())
