"""Seconds from launch to the main window, under Xvfb: mapped (seen by xdotool, polled every 20 ms from
outside) and its first frame exposed (the app's own timestamp, KVCHAT_STARTUP_TRACE), each run in a
fresh KVCHAT_HOME; then the median and the spread.

    xvfb-run -a python tools/window_time.py [--app .venv/bin/kvchat] [--runs 5]
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

POLL_S = 0.02


def mapped(pid: int) -> bool:
    args = ["xdotool", "search", "--onlyvisible", "--pid", str(pid), "--name", "^kvchat$"]
    return bool(subprocess.run(args, capture_output=True, text=True).stdout.split())


def one_run(app: str, timeout: float = 60) -> dict:
    home = tempfile.mkdtemp(prefix="kvchat-window-")
    env = {**os.environ, "KVCHAT_HOME": home, "KVCHAT_STARTUP_TRACE": "1"}
    err = tempfile.TemporaryFile()
    start = time.monotonic()
    proc = subprocess.Popen([app], env=env, stdout=subprocess.DEVNULL, stderr=err)
    out = {}
    try:
        while time.monotonic() - start < timeout and proc.poll() is None:
            if mapped(proc.pid):
                out["mapped_s"] = round(time.monotonic() - start, 3)
                break
            time.sleep(POLL_S)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and "exposed_s" not in out:  # the trace follows the map
            err.seek(0)
            found = re.search(rb"first frame ([\d.]+) s", err.read())
            if found:
                out["exposed_s"] = float(found.group(1))
            else:
                time.sleep(POLL_S)
    finally:
        proc.terminate()
        proc.wait(30)
    return out


def summary(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": min(values), "max": max(values)} if values else {}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--app", default=os.path.join(os.path.dirname(sys.executable), "kvchat"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    runs = [one_run(args.app) for _ in range(args.runs)]
    print(json.dumps({"app": args.app, "runs": runs,
                      "mapped_s": summary([r["mapped_s"] for r in runs if "mapped_s" in r]),
                      "exposed_s": summary([r["exposed_s"] for r in runs if "exposed_s" in r])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
