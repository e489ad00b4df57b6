"""``kvchat bench ui`` as a user runs it (the README documents it): the real window and bridge on a
canned backend, in its own process, offscreen."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_ui_streams_into_the_real_window_and_reports_per_token_cost():
    kvchat = str(Path(sys.executable).parent / "kvchat")
    r = subprocess.run([kvchat, "bench", "ui", "--tokens", "30", "--json"], capture_output=True, text=True,
                       timeout=600, env={**os.environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert sorted(result["runs"]) == ["10", "200"]
    bars, worst = result["bars"], max(result["ms_per_token"].values())
    assert (bars["ms_per_token"], bars["ratio"]) == (2.0, 1.2)
    assert bars["ms_met"] == (worst <= 2.0) and bars["ratio_met"] == (result["ratio"] <= 1.2)
    for n, run in result["runs"].items():
        # measure() raises unless the streamed reply reached the view: a run is a reply shown
        assert run["messages"] == int(n) and run["tokens"] == 30 and run["gui_cpu_s"] > 0
        assert run["ms_per_token"] == pytest.approx(1000 * run["gui_cpu_s"] / 30, abs=0.005)  # gui_cpu_s is rounded
