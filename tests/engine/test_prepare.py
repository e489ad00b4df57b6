"""kvchat prepare waits for each compile a reply started, from the engine's notices."""
import threading

from kvchat.engine.precompile import Compiles
from kvchat.core.events import Notice


def test_a_compile_is_waited_for_until_it_is_said_ready_or_eager():
    compiles = Compiles()
    assert compiles.wait(0)  # nothing announced: nothing to wait for
    compiles.on_event(Notice("warm-up", "preparing fast decoding in the background: replies start at once"))
    compiles.on_event(Notice("evict", "3 cached block(s) evicted"))  # other notices change nothing
    assert not compiles.wait(0.05)
    threading.Timer(0.05, compiles.on_event, [Notice("warm-up", "fast decoding ready (12 s)")]).start()
    assert compiles.wait(10)
    compiles.on_event(Notice("warm-up", "preparing fast decoding in the background: replies start at once"))
    compiles.on_event(Notice("eager", "decoding without compilation (no C++ compiler found)"))
    assert compiles.wait(0)
    assert compiles.outcomes == ["fast decoding ready (12 s)", "decoding without compilation (no C++ compiler found)"]
