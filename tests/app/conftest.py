"""The app's tests share a starter model in memory; each test gets a fresh window, engine and
SQLite file."""

import pytest

from kvchat.app.controllers.engine_bridge import EngineBridge
from kvchat.app.views.main_window import MainWindow
from kvchat.app.store import Store
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.model.loading import LoadedModel



@pytest.fixture
def app_parts(qtbot, tmp_path, engine_model):
    def make_engine(settings):
        """The starter from memory (no reload per test); any other model loads for real."""
        if settings.get("model", "starter") == "starter":
            return Engine(EngineConfig(max_context=settings.get("max_context", 512)),
                          loaded=LoadedModel(**vars(engine_model)), persona_store=None)
        return Engine(EngineConfig(model=settings["model"], max_context=512), persona_store=None)

    engine = make_engine({})
    bridge = EngineBridge(engine, make_engine)
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, bridge, SamplingParams(max_new_tokens=12, temperature=0))
    qtbot.addWidget(win)
    win.show()  # the QML view makes the delegates a reader could see: a hidden one has none
    qtbot.waitExposed(win)
    qtbot.waitUntil(engine.ready.is_set, timeout=60000)
    yield win, store, bridge, tmp_path
    bridge.engine.close()
    engine.close()


