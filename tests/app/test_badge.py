"""The warm/cold badge asks the engine (issue 10, deliverable 7): warm when the persona's prefix is in
the pool, "on disk" when its saved KV would be restored, cold otherwise; never blank once loaded."""
from kvchat.app.controllers.engine_bridge import EngineBridge
from kvchat.app.views.main_window import MainWindow
from kvchat.app.store import Store
from kvchat.core.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.model.loading import LoadedModel
from kvchat.engine.kv.disk_tier import DiskTier

from qt_helpers import send, shown


def window(qtbot, store, engine_model, kv_folder):
    engine = Engine(EngineConfig(max_context=512), loaded=LoadedModel(**vars(engine_model)),
                    disk_tier=DiskTier(kv_folder))
    win = MainWindow(store, EngineBridge(engine), SamplingParams(max_new_tokens=8, temperature=0))
    qtbot.addWidget(win)
    shown(qtbot, win)
    qtbot.waitUntil(lambda: win.models.config is not None, timeout=60000)
    return win


def badge(win):
    """The engine's answer, once it is the answer for the persona in view."""
    shown_for = win.persona_badge.property("persona")
    return win.persona_badge.property("state") if shown_for == win.persona_box.currentData() else None


def test_the_badge_says_what_the_engine_holds_across_a_restart(qtbot, tmp_path, engine_model):
    store = Store(tmp_path / "chat.db")
    win = window(qtbot, store, engine_model, tmp_path / "kv")
    try:
        win.chats.new()
        win.persona_box.setCurrentIndex(2)  # a persona longer than one block
        qtbot.waitUntil(lambda: badge(win) == "cold", timeout=10000)  # known before the first reply
        assert win.persona_badge.text() == "not prepared yet"
        send(qtbot, win, "Hello")
        qtbot.waitUntil(lambda: badge(win) == "warm", timeout=10000)
        assert win.persona_badge.text() == "ready in memory"
    finally:
        win.bridge.engine.close()
    again = window(qtbot, store, engine_model, tmp_path / "kv")  # a restart: an empty pool, the same disk
    try:
        chat = store.conversations()[0]["id"]
        again.chats.open(chat)
        qtbot.waitUntil(lambda: badge(again) == "disk", timeout=10000)
        assert again.persona_badge.text() == "ready, saved on disk"
        send(qtbot, again, "Hello again")
        assert store.messages(chat)[-1].stats["cached_tokens"] > 0  # it was restored, as the badge said
        qtbot.waitUntil(lambda: badge(again) == "warm", timeout=10000)
    finally:
        again.bridge.engine.close()
