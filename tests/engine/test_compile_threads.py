"""Compiling beside a running reply: torch.fx's process-wide patches stay on the tracing thread,
and a compile child is started once per graph, stopped with the engine, and only where it fits."""
import logging
import threading

import torch
from torch import nn

from kvchat.core.config import EngineConfig
from kvchat.engine.compile_env import confine_fx_patches
from kvchat.engine import compile_child
from kvchat.engine.compile_child import SPARE_BYTES, CacheWarmer

from polling import wait_for


class _Held(nn.Module):
    """A module whose forward waits, so that a trace of it holds fx's patches in place."""

    def __init__(self, inside: threading.Event, release: threading.Event):
        super().__init__()
        self.lin, self.inside, self.release = nn.Linear(2, 2), inside, release

    def forward(self, x):
        self.inside.set()
        self.release.wait(10)
        return self.lin(x)


def test_a_module_called_on_another_thread_during_a_trace_runs_as_itself():
    confine_fx_patches()
    inside, release = threading.Event(), threading.Event()
    traced = {}
    tracer = threading.Thread(target=lambda: traced.update(graph=torch.fx.symbolic_trace(_Held(inside, release))))
    tracer.start()
    try:
        assert inside.wait(10)
        other = nn.Sequential(nn.Linear(2, 3))
        x = torch.ones(1, 2)
        # unconfined, the call went through the tracer: NameError "module is not installed as a submodule"
        assert torch.equal(other(x), torch.nn.functional.linear(x, other[0].weight, other[0].bias))
        assert other.training is True  # __getattr__ as well
    finally:
        release.set()
        tracer.join(10)
    calls = [n.target for n in traced["graph"].graph.nodes if n.op == "call_module"]
    assert calls == ["lin"]  # the tracing thread still traced through its own module


def test_the_warmer_starts_only_where_a_second_copy_of_the_weights_fits(monkeypatch):
    monkeypatch.delenv(compile_child.HERE, raising=False)
    cpu = EngineConfig(model="starter", device="cpu", weights="int8", decode="auto")
    weights = 300 << 20
    assert CacheWarmer.for_model(cpu, "cpu", weights + SPARE_BYTES, weights).spec == {
        "model": "starter", "device": "cpu", "dtype": "auto", "weights": "int8", "decode": "auto"}
    assert CacheWarmer.for_model(cpu, "cpu", weights + SPARE_BYTES - 1, weights) is None
    assert CacheWarmer.for_model(EngineConfig(device="auto"), "cuda", 1 << 40, weights) is None
    assert CacheWarmer.for_model(EngineConfig(decode="eager"), "cpu", 1 << 40, weights) is None
    monkeypatch.setenv(compile_child.HERE, "1")  # a child makes no child of its own
    assert CacheWarmer.for_model(cpu, "cpu", 1 << 40, weights) is None


def test_a_child_is_started_once_per_graph_and_stopped_on_close(monkeypatch, caplog):
    """Stopped on purpose, the child is logged as stopped, not as a compile that failed (-9); one
    that fails on its own is still a warning."""
    caplog.set_level(logging.INFO, logger="kvchat.decode")
    started = []
    monkeypatch.setattr(compile_child, "CHILD_CODE", "import time, sys; time.sleep(60)")
    warmer = CacheWarmer({"model": "starter", "device": "cpu", "dtype": "auto", "weights": "int8"})
    real_popen = compile_child.subprocess.Popen
    monkeypatch.setattr(compile_child.subprocess, "Popen", lambda cmd, **kw: started.append(cmd) or real_popen(cmd, **kw))
    assert warmer.start("traced") and not warmer.start("traced")
    assert warmer.running("traced") and not warmer.running("op")
    assert not warmer.start("op")  # one child at a time: each holds a copy of the weights
    assert not warmer.done("traced") and not warmer.done("op")
    assert len(started) == 1 and '"kind": "traced"' in started[0][-1] and '"threads": ' in started[0][-1]
    warmer.close()
    assert not warmer.running("traced") and warmer.done("traced")
    assert wait_for(lambda: "traced graph's compile child was stopped" in caplog.text)
    assert "ended with" not in caplog.text
    monkeypatch.setattr(compile_child, "CHILD_CODE", "import sys; sys.exit('no compiler here')")
    assert warmer.start("op") and len(started) == 2  # the next graph's child, once the first has ended
    assert wait_for(lambda: "the op graph's compile child ended with 1" in caplog.text)
    assert [r.levelname for r in caplog.records if "ended with" in r.message] == ["WARNING"]
    warmer.close()


class _Step:
    """What ``prepare_decode`` asks of a decode step: the graph it wants, and what it queued."""

    def __init__(self):
        self.device, self.captured, self.fallback, self.prepared = torch.device("cpu"), False, None, 0
        self.background = type("Background", (), {"take_finished": staticmethod(lambda: [])})()

    def graph_wanted(self, kv):
        return "traced"

    def prepare(self, kv):
        self.prepared += 1
        return True


class _Batch:
    """The batched step's side: how often it was asked to compile its graphs."""

    def __init__(self):
        self.prepared = 0

    def prepare(self, kv):
        self.prepared += 1
        return False


class _Warmer:
    def __init__(self):
        self.started, self.ended = [], False

    def start(self, kind):
        self.started.append(kind)
        return len(self.started) == 1

    def done(self, kind):
        return self.ended

    def expected(self, kind):
        return None  # the first compile here


def test_with_a_compile_child_this_process_compiles_nothing_until_it_ended_and_then_only_when_idle():
    """A compile on a thread here holds the GIL: a reply's tokens slowed to 2 tok/s for the int8
    twins' compile. With a child compiling the graph and the twins, this process queues its own
    compile (from the child's cache) only once the child ended, and never between two tokens."""
    from types import SimpleNamespace

    from kvchat.core.config import EngineConfig
    from kvchat.engine.host import ModelHost, preparing
    from kvchat.engine.load_order import LoadOrder

    class Outbox:
        def notice(self, kind, message):
            notices.append((kind, message))

    step, notices = _Step(), []
    batch = _Batch()
    session = SimpleNamespace(kvpool=SimpleNamespace(runner=SimpleNamespace(step=step, batch=batch), kv=object()))
    host = ModelHost(Outbox(), LoadOrder(), EngineConfig(), None, None)
    host.warmer = warmer = _Warmer()
    host.prepare_decode(session)
    host.prepare_decode(session, between_tokens=True)
    assert (warmer.started, notices, step.prepared) == (["traced", "traced"], [("warm-up", preparing(None))], 0)
    assert batch.prepared == 1  # asked in the idle moment only, never between two tokens
    warmer.ended = True
    host.prepare_decode(session, between_tokens=True)
    assert step.prepared == 0
    host.prepare_decode(session)
    assert step.prepared == 1 and len(notices) == 1


def test_the_compile_notice_says_what_the_last_compile_took_on_this_machine(tmp_path, monkeypatch):
    """A child's compile time is kept per model, kind and instruction set; the next start's notice
    gives it, which the app's progress line counts against."""
    from kvchat.core.config import EngineConfig
    from kvchat.engine.compile_child import CacheWarmer
    from kvchat.engine.host import preparing

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    warmer = CacheWarmer.for_model(EngineConfig(decode="auto"), "cpu", 64 << 30, 1 << 30)
    assert warmer.expected("traced") is None
    assert preparing(None).endswith("(a minute or more the first time)")
    warmer._remember("traced", 131.4)
    again = CacheWarmer.for_model(EngineConfig(decode="auto"), "cpu", 64 << 30, 1 << 30)
    assert again.expected("traced") == 131.4 and again.expected("op") is None
    assert CacheWarmer.for_model(EngineConfig(decode="auto", weights="int4"), "cpu", 64 << 30, 1 << 30).expected(
        "traced") is None  # another weight format: another compile
    assert preparing(131.4).endswith("(it took 2 min here the last time)")
    assert preparing(42).endswith("(it took 42 s here the last time)")
