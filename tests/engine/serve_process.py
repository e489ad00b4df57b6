"""``kvchat serve`` as its own process on a free loopback port with an API key: the remote of the
engine's and the app's remote tests."""
import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, proc, headers=None, deadline_s: float = 300) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url, headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"{url} did not come up")


@contextmanager
def kvchat_serve(log_dir, key: str, context: int = 2048):
    """Yields the server's base URL; the server's log is in the failure when it does not come up."""
    with kvchat_serve_process(log_dir, key, context) as (url, _proc):
        yield url


@contextmanager
def kvchat_serve_process(log_dir, key: str, context: int = 2048):
    """Yields the server's base URL and its process; its log is ``log_dir / "serve.log"``."""
    port = free_port()
    log = open(log_dir / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "kvchat.cli.main", "serve", "--port", str(port),
                             "--api-key", key, "--context", str(context), "--decode", "eager"],
                            stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url + "/health", proc, {"Authorization": f"Bearer {key}"})
    except AssertionError:
        proc.kill()
        log.seek(0)
        raise AssertionError(log.read()[-3000:]) from None
    try:
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
