"""Where no window can open, ``kvchat`` says why in one line (cli/launcher.py), rather than Qt
aborting the process with its hint about libxcb-cursor0."""
import os
import socket
import subprocess
import sys
from pathlib import Path

from kvchat.cli.launcher import x_server_answers

KVCHAT = str(Path(sys.executable).parent / "kvchat")


def run_kvchat(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}
    return subprocess.run([KVCHAT], capture_output=True, text=True, env={**base, **env}, timeout=120)


def unused_display() -> str:
    """A display number no X server listens on: no socket file, and nothing at its abstract name."""
    def free(n: int) -> bool:
        if Path(f"/tmp/.X11-unix/X{n}").exists():
            return False
        with socket.socket(socket.AF_UNIX) as sock:
            return sock.connect_ex(f"\0/tmp/.X11-unix/X{n}") != 0
    return f":{next(n for n in range(173, 400) if free(n))}"


def test_kvchat_without_a_display_says_so_in_one_line():
    r = run_kvchat()
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "kvchat: no display found (DISPLAY is not set); for the terminal chat run: kvchat chat"]


def test_kvchat_with_a_display_no_x_server_answers_says_so_in_one_line():
    """DISPLAY set, nothing there: Qt aborted (exit -6) and blamed libxcb-cursor0."""
    display = unused_display()
    r = run_kvchat(DISPLAY=display)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        f"kvchat: no X server answers on DISPLAY={display}; start one or set DISPLAY to it, or for the terminal "
        "chat run: kvchat chat"]


def test_an_x_server_answers_while_it_runs_and_not_after():
    """A real Xvfb (package-check's own display server): the answer follows it."""
    read, write = os.pipe()
    xvfb = subprocess.Popen(["Xvfb", "-displayfd", str(write), "-nolisten", "tcp"], pass_fds=(write,),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(write)
    try:
        with os.fdopen(read) as number:  # written once the server takes connections
            display = f":{number.readline().strip()}"
        assert x_server_answers(display)
    finally:
        xvfb.terminate()
        xvfb.wait(10)
    assert not x_server_answers(display)
