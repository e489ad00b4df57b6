"""The app's side of the KV tiers: a deleted chat is forgotten by the engine, Settings hold both
caps and clear every cached conversation."""
from PySide6.QtCore import Qt

from kvchat.app.controllers.engine_bridge import settings_config
from kvchat.app.views.sheet import Question
from kvchat.core.config import DISK_CACHE_BYTES
from kvchat.core.memory import GiB

from qt_helpers import answering, click_chat, shown, yes


def test_deleting_a_chat_tells_the_engine_to_forget_its_messages(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    forgotten = []
    bridge.engine.forget = forgotten.append
    shown(qtbot, win)
    doomed = store.create_conversation("Trip to Lisbon")
    store.add_message(doomed, "user", "Plan three days in Lisbon")
    store.add_message(doomed, "assistant", "Day one: Alfama.", token_ids=[5, 6, 7])
    win.chats.refresh()
    click_chat(qtbot, win, "Trip to Lisbon")
    with answering(Question, yes):
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)
    assert forgotten == [[{"role": "user", "content": "Plan three days in Lisbon"},
                          {"role": "assistant", "content": "Day one: Alfama.", "token_ids": [5, 6, 7]}]]


def test_settings_hold_both_caps_and_clear_cached_conversations(qtbot, app_parts):
    win, _, bridge, _ = app_parts
    forgotten = []
    bridge.engine.forget = forgotten.append
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    defaults = settings_config(dialog.engine_settings())
    assert defaults.ram_cache_bytes is None and defaults.disk_cache_bytes == DISK_CACHE_BYTES
    dialog.ram_cache.setValue(2)
    dialog.disk_cache.setValue(8)
    chosen = settings_config(dialog.engine_settings())
    assert chosen.ram_cache_bytes == 2 * GiB and chosen.disk_cache_bytes == 8 * GiB
    dialog.disk_cache.setValue(0)
    assert settings_config(dialog.engine_settings()).disk_cache_bytes == 0  # off
    qtbot.mouseClick(dialog.clear_button, Qt.LeftButton)
    assert forgotten == [None]


def test_the_memory_panel_shows_each_tiers_use_capacity_and_hits(qtbot):
    from kvchat.app.views.memory_panel import MemoryPanel

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    snapshot = {"device": "cpu", "total": 24 * GiB, "other_processes": GiB, "weights": GiB, "kv_total": GiB,
                "kv_in_use": 0, "kv_reclaimable": 0, "activations_reserve": GiB // 4, "free": 20 * GiB,
                "precision": "int8", "max_context": {}, "on_cpu": True, "runtime": 600 << 20,
                "tiers": {"ram_used": 512 << 20, "ram_capacity": 4 * GiB, "ram_hits": 375,
                          "disk_used": GiB, "disk_capacity": 4 * GiB, "disk_hits": 12}}
    panel.show_snapshot(snapshot)
    text = panel.tiers.text()
    assert "RAM cache" in text and "0.50 GiB of 4.00 GiB" in text and "375 hits" in text
    assert "disk cache" in text and "1.00 GiB of 4.00 GiB" in text and "12 hits" in text
