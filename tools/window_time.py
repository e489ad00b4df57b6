"""Seconds from launch to the first visible window (the splash) and to the main window, under Xvfb.

    xvfb-run -a python tools/window_time.py [--app .venv/bin/kvchat] [--runs 3]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def visible(pid: int, name: str | None = None) -> bool:
    args = ["xdotool", "search", "--onlyvisible", "--pid", str(pid)] + (["--name", name] if name else ["--name", "."])
    return bool(subprocess.run(args, capture_output=True, text=True).stdout.split())


def one_run(app: str) -> dict:
    home = tempfile.mkdtemp(prefix="kvchat-window-")
    env = {**os.environ, "KVCHAT_HOME": home}
    start = time.monotonic()
    proc = subprocess.Popen([app], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = {}
    try:
        while "window_s" not in out and time.monotonic() - start < 60:
            if "first_window_s" not in out and visible(proc.pid):
                out["first_window_s"] = round(time.monotonic() - start, 2)
            if visible(proc.pid, "^kvchat$"):
                out["window_s"] = round(time.monotonic() - start, 2)
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(10)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", default=os.path.join(os.path.dirname(sys.executable), "kvchat"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run(args.app) for _ in range(args.runs)]
    print(json.dumps({"runs": runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
