"""Each test gets a fresh window and SQLite file. ``app_parts``: the window on the fake backend
(tests/support), for what is about the GUI; ``engine_parts``: on a real engine over the suite's
shared starter, for the end-to-end paths (test_end_to_end.py and a few others)."""

import pytest

from kvchat.app.controllers.engine_bridge import EngineBridge
from kvchat.app.views.main_window import MainWindow
from kvchat.app.store import Store
from kvchat.core.config import EngineConfig, SamplingParams

from qt_helpers import lockstep
from support.fake_backend import FakeBackend


def window(qtbot, tmp_path, engine, make_engine):
    bridge = EngineBridge(engine, make_engine)
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, bridge, SamplingParams(max_new_tokens=12, temperature=0))
    qtbot.addWidget(win)
    win.show()  # the QML view makes the delegates a reader could see: a hidden one has none
    qtbot.waitExposed(win)
    qtbot.waitUntil(lambda: not bridge.loading, timeout=60000)
    return win, store, bridge


def fake_engine(settings: dict) -> FakeBackend:
    """The window's local engine, as the ``kvchat`` command makes it, faked; it streams in lockstep
    with the window (support/pace.py)."""
    fake = FakeBackend(EngineConfig(model=settings.get("model", "starter"), max_context=settings.get("max_context", 512)))
    fake.pace.lockstep()
    return fake


@pytest.fixture
def app_parts(qtbot, tmp_path):
    engine = fake_engine({})
    win, store, bridge = window(qtbot, tmp_path, engine, fake_engine)
    lockstep(bridge)
    yield win, store, bridge, tmp_path
    bridge.engine.close()
    engine.close()


@pytest.fixture
def engine_parts(qtbot, tmp_path, engine_model):
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.loading import LoadedModel

    def make_engine(settings):
        """The starter from memory (no reload per test); any other model loads for real."""
        if settings.get("model", "starter") == "starter":
            return Engine(EngineConfig(max_context=settings.get("max_context", 512)),
                          loaded=LoadedModel(**vars(engine_model)), disk_tier=None)
        return Engine(EngineConfig(model=settings["model"], max_context=512), disk_tier=None)

    engine = make_engine({})
    win, store, bridge = window(qtbot, tmp_path, engine, make_engine)
    yield win, store, bridge, tmp_path
    bridge.engine.close()
    engine.close()
