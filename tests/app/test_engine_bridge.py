"""The bridge as one adapter: its state changes only when a queued signal is delivered on the GUI
thread, through real signals from the fake backend (tests/support), which gives the engine's events
in the engine's order from its own thread."""
import pytest

from kvchat.app.controllers.engine_bridge import EngineBridge
from kvchat.core.config import EngineConfig, SamplingParams

from qt_helpers import lockstep, settled
from support.fake_backend import FakeBackend


HELLO = [{"role": "user", "content": "Write a long story about a dragon."}]


@pytest.fixture
def bridge(qtbot):
    engine = FakeBackend(EngineConfig(max_context=512))
    engine.pace.lockstep()
    b = EngineBridge(engine)
    lockstep(b)
    assert b.loading  # nothing delivered yet, whatever the engine thread has done meanwhile
    with qtbot.waitSignal(b.ready, timeout=60000):
        pass
    yield b
    engine.close()


def test_the_first_load_arrives_as_a_signal_however_fast_it_failed(qtbot):
    engine = FakeBackend(EngineConfig(model="/no/such/model.gguf"))
    engine.ready.wait(60)  # the failure is over before the bridge exists
    b = EngineBridge(engine)
    with qtbot.waitSignal(b.load_failed, timeout=10000) as failed:
        pass
    assert "no such model file" in failed.args[0] and not b.loading and b.load_error
    engine.close()


def test_busy_ends_when_finished_is_delivered_not_before(qtbot, bridge):
    ends = []
    bridge.finished.connect(lambda key, done: ends.append(bridge.busy))
    bridge.engine.pace.free()  # the reply runs to its end with no event delivered
    key = bridge.send(HELLO, SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
    assert bridge.busy
    bridge.handles[key].future.result(30)  # the engine has finished; without delivery nothing changes
    assert bridge.busy and not ends
    with qtbot.waitSignal(bridge.finished, timeout=60000) as done:
        pass
    assert ends == [False] and done.args == [key, done.args[1]] and done.args[1]["finish_reason"] == "length"
    assert not bridge.busy


def test_stop_gives_a_cancelled_finish_with_the_partial_reply(qtbot, bridge):
    tokens = []
    bridge.token.connect(lambda key, text, tid: (tokens.append(text), len(tokens) == 3 and bridge.stop(key)))
    bridge.send(HELLO, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
    with qtbot.waitSignal(bridge.finished, timeout=60000) as done:
        pass
    reply = done.args[1]
    assert reply["finish_reason"] == "cancelled" and 3 <= len(reply["token_ids"]) < 400
    assert reply["text"].startswith("".join(tokens[:3])) and not bridge.busy


def test_two_switches_in_a_row_end_in_one_ready_with_the_second_settings(qtbot, bridge):
    readies, failures = [], []
    bridge.ready.connect(lambda: readies.append(dict(bridge.settings)))
    bridge.load_failed.connect(failures.append)
    bridge.switch_model({"model": "starter", "max_context": 256, "kv_precision": "fp16"})
    bridge.switch_model({"model": "starter", "max_context": 384, "kv_precision": "int8"})
    assert bridge.loading
    qtbot.waitUntil(lambda: bool(readies), timeout=120000)
    settled(bridge)  # whatever else the engine had to say has been delivered
    assert failures == [] and len(readies) == 1 and readies[0]["max_context"] == 384
    assert bridge.precision == "int8" and not bridge.loading


def test_a_failed_switch_says_why_and_keeps_the_previous_settings(qtbot, bridge):
    before = dict(bridge.settings)
    with qtbot.waitSignal(bridge.load_failed, timeout=120000) as failed:
        bridge.switch_model({"model": "/no/such/model.gguf"})
    assert "the previous model is back" in failed.args[0]
    assert bridge.settings["model"] == before["model"] and not bridge.loading and bridge.load_error is None
    with qtbot.waitSignal(bridge.finished, timeout=60000):
        bridge.send(HELLO, SamplingParams(max_new_tokens=2, temperature=0))


def test_a_switch_during_a_reply_ends_it_cancelled(qtbot, bridge):
    bridge.token.connect(lambda key, text, tid: bridge.loading or bridge.switch_model({"model": "starter",
                                                                                "max_context": 256}))
    with qtbot.waitSignal(bridge.finished, timeout=60000) as done:
        bridge.send(HELLO, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
    assert done.args[1]["finish_reason"] == "cancelled"
    qtbot.waitUntil(lambda: not bridge.loading, timeout=120000)
    assert bridge.settings["max_context"] == 256


def test_reconfigure_and_after_close_a_failure_signal(qtbot, bridge):
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000) as got:
        bridge.reconfigure(256, "int4")
    assert got.args[0]["kv_precision"] == "int4" and bridge.precision == "int4"
    bridge.engine.close()
    with qtbot.waitSignal(bridge.failed, timeout=10000) as failed:
        bridge.reconfigure(512, "fp16")
    assert "shut down" in failed.args[0]


class PausedBackend:
    """A backend named ``model`` whose reconfigure answers only when the test sets ``answer``."""

    alive = True

    def __init__(self, model: str):
        import threading
        from concurrent.futures import Future

        self.model, self.load_error, self.answer = model, None, Future()
        self.ready = threading.Event()
        self.ready.set()

    def add_listener(self, callback, replay: bool = False) -> None:
        from kvchat.core.events import ModelReady

        if replay:
            callback(ModelReady(self.model, {"model": self.model, "max_context": 512, "kv_precision": "fp16",
                                             "precision": "fp16"}))

    def reconfigure(self, **changes):
        return self.answer

    def close(self) -> None:
        pass


def test_a_reconfigure_answered_after_a_switch_leaves_the_new_backends_settings(qtbot):
    """The answer comes from the backend it was asked of: after a switch (to a connection, say) it
    must not overwrite what the new backend said."""
    from PySide6.QtCore import QCoreApplication

    first, second = PausedBackend("first"), PausedBackend("second")
    b = EngineBridge(first)
    with qtbot.waitSignal(b.ready, timeout=5000):
        pass
    b.reconfigure(1024, "int8")
    b.use_backend(second)
    with qtbot.waitSignal(b.ready, timeout=5000):
        pass
    first.answer.set_result({"model": "first", "max_context": 1024, "kv_precision": "int8", "precision": "int8"})
    QCoreApplication.processEvents()  # the answer's queued delivery
    assert (b.settings["model"], b.settings["max_context"], b.precision) == ("second", 512, "fp16")


def test_two_replies_each_keep_their_key_and_stop_ends_only_its_own(qtbot, bridge):
    """The fake serves one request after the other; the second one, stopped before its first token,
    ends at once, and the first streams on to its own end under its own key."""
    tokens, ends = [], []
    bridge.token.connect(lambda key, text, tid: tokens.append(key))
    bridge.finished.connect(lambda key, done: ends.append((key, done["finish_reason"])))
    first = bridge.send(HELLO, SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
    second = bridge.send(HELLO, SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True))
    assert first != second and set(bridge.handles) == {first, second}
    bridge.stop(second)
    assert ends == [(second, "cancelled")] and set(bridge.handles) == {first}
    qtbot.waitUntil(lambda: len(ends) == 2, timeout=60000)
    settled(bridge)
    assert ends[1] == (first, "length") and tokens == [first] * 5 and not bridge.busy
