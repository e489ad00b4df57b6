"""Waiting in tests for what an engine thread does on its own time (a memory tick, a notice)."""
import time


def wait_for(predicate, timeout=20) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.1)
    return False
