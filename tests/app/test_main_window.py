"""The main window on the starter model, offscreen, with a real SQLite file."""
import json
from contextlib import contextmanager

import pytest
from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QMessageBox

from kvchat.app.engine_bridge import EngineBridge
from kvchat.app.main_window import MainWindow
from kvchat.app.settings_dialog import SettingsDialog
from kvchat.app.store import Store
from kvchat.engine.config import EngineConfig, SamplingParams
from kvchat.engine.engine import Engine
from kvchat.engine.models import LoadedModel

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
from tiny_models import as_loaded  # noqa: E402


@pytest.fixture(scope="module")
def shared(starter):
    return as_loaded(starter.model, starter.tokenizer, "starter")


@pytest.fixture
def app_parts(qtbot, tmp_path, shared):
    def make_engine(settings):
        """The starter from memory (no reload per test); any other model loads for real."""
        if settings.get("model", "starter") == "starter":
            return Engine(EngineConfig(max_context=settings.get("max_context", 512)),
                          loaded=LoadedModel(**vars(shared)), persona_store=None)
        return Engine(EngineConfig(model=settings["model"], max_context=512), persona_store=None)

    engine = make_engine({})
    bridge = EngineBridge(engine, make_engine)
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, bridge, SamplingParams(max_new_tokens=12, temperature=0))
    qtbot.addWidget(win)
    qtbot.waitUntil(engine.ready.is_set, timeout=60000)
    yield win, store, bridge, tmp_path
    bridge.engine.close()
    engine.close()


def back_on_the_starter(qtbot, bridge, store):
    # waitSignal may return before the window's own (queued) slot has started the way back
    # generous: in two full-suite runs of five the way back took over 60 s (cause not found; alone
    # these tests take seconds)
    qtbot.waitUntil(lambda: not bridge.switching and bridge.engine.ready.is_set()
                    and bridge.engine.config.model == "starter", timeout=150000)
    assert bridge.engine.load_error is None
    # the window saves the setting in its own queued slot, after the engine is ready
    qtbot.waitUntil(lambda: (store.setting("engine") or {}).get("model") == "starter", timeout=10000)


def send(qtbot, win, text):
    win.input.setPlainText(text)
    win.send()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=60000)


@contextmanager
def answering(kind, act):
    """Answer the first ``kind`` dialog opened modally inside the block (exec() and
    QMessageBox.question wait in their own event loop, where this timer runs). Yields a list that
    holds what ``act`` returned, or nothing if no such dialog opened."""
    answered = []

    def poll():
        dialog = QApplication.activeModalWidget()
        if isinstance(dialog, kind) and dialog.isVisible() and not answered:
            answered.append(act(dialog))

    timer = QTimer(interval=20)
    timer.timeout.connect(poll)
    timer.start()
    try:
        yield answered
    finally:
        timer.stop()


def press(button):
    """A message box answer: returns the question the box asked."""
    def act(box):
        text = box.text()
        box.button(button).click()
        return text
    return act


def click_chat(qtbot, win, title):
    chats = win.conversation_list
    item = chats.findItems(title, Qt.MatchExactly)[0]
    qtbot.mouseClick(chats.viewport(), Qt.LeftButton, pos=chats.visualItemRect(item).center())


def chat_ids(store):
    return {c["id"] for c in store.conversations("")}


def shown(qtbot, win):
    win.show()
    qtbot.waitExposed(win)
    return win


def test_send_streams_the_reply_and_saves_it(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    tokens = []
    bridge.token.connect(lambda text, tid: tokens.append(text))
    send(qtbot, win, "What is the capital of France?")
    user, reply = store.messages(win.conversation_id)
    assert user.content == "What is the capital of France?" and not reply.interrupted
    assert len(tokens) > 1 and reply.content == "".join(tokens)
    assert reply.token_ids and reply.stats["prompt_tokens"] > 0
    assert "Paris" in win.chat_view.toPlainText()
    assert "TTFT" in win.chat_view.toPlainText() and "cached" in win.chat_view.toPlainText()


def test_stop_keeps_the_partial_reply_marked_interrupted(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    bridge.token.connect(lambda *a: win.stop_button.click())
    send(qtbot, win, "Write a very long story.")
    reply = store.messages(win.conversation_id)[-1]
    assert reply.interrupted and 0 < len(reply.token_ids) < 400


def test_regenerate_replaces_the_last_reply_and_edit_resends(qtbot, app_parts):
    win, store, _, _ = app_parts
    send(qtbot, win, "Name a color.")
    first = store.messages(win.conversation_id)[-1]
    win.regenerate()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=60000)
    messages = store.messages(win.conversation_id)
    assert len(messages) == 2 and messages[-1].content == first.content  # greedy: the same reply again
    assert messages[-1].stats["cached_tokens"] > first.stats["cached_tokens"]  # from the prefix cache
    send(qtbot, win, "And another?")
    assert len(store.messages(win.conversation_id)) == 4
    assert win.chat_view.toPlainText().count("TTFT") == 2  # stats under each reply
    from PySide6.QtCore import QUrl

    win.on_link(QUrl("edit:0"))  # the "edit" link under the first message
    assert win.input.toPlainText() == "Name a color." and win.send_button.text() == "Resend"
    win.escape()  # cancels the edit
    assert win.editing is None and not win.input.toPlainText() and win.send_button.text() == "Send"
    win.on_link(QUrl("edit:0"))
    send(qtbot, win, "Name a fruit.")
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[0].content == "Name a fruit."
    assert messages[1].content and win.send_button.text() == "Send"


def test_persona_switch_is_saved_and_shown_warm_after_use(qtbot, app_parts):
    win, store, _, _ = app_parts
    win.new_conversation()
    win.persona_box.setCurrentIndex(2)
    assert store.conversation(win.conversation_id)["persona_id"] == win.persona_box.currentData()
    assert win.persona_badge.text() == "cold"
    send(qtbot, win, "Hello")
    assert win.persona_badge.text() == "warm (cached)"


def test_gauge_receives_snapshots_and_precision_changes_without_reload(qtbot, app_parts):
    win, _, bridge, _ = app_parts
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=10000)
    assert win.gauge.snapshot["on_cpu"] and "on the CPU" in win.precision_label.text()
    from kvchat.app.gauge import segments

    parts = dict((label, size) for label, size, _ in segments(win.gauge.snapshot))
    assert sum(parts.values()) == win.gauge.snapshot["total"]  # the bar accounts for every byte
    assert parts["KV in use"] + parts["prefix cache"] + parts["KV free"] == win.gauge.snapshot["kv_total"]
    model = bridge.engine.loaded.model
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000) as got:
        bridge.reconfigure(1024, "int8")
    assert got.args[0]["kv_precision"] == "int8" and bridge.engine.loaded.model is model
    send(qtbot, win, "Hi again")
    assert win.chat_view.toPlainText().rstrip().endswith("KV int8")  # the newest reply's stats


def test_conversations_survive_a_restart_and_empty_input_sends_nothing(qtbot, app_parts):
    win, store, bridge, tmp_path = app_parts
    send(qtbot, win, "Remember me")
    win.input.setPlainText("   ")
    win.send()
    assert len(store.messages(win.conversation_id)) == 2
    win.close()
    again = MainWindow(Store(tmp_path / "chat.db"), bridge)  # a new connection, as after a restart
    qtbot.addWidget(again)
    assert again.conversation_list.count() == 1
    again.conversation_list.setCurrentRow(0)
    assert "Remember me" in again.chat_view.toPlainText()


def test_settings_show_the_planner_live_and_apply_without_reload(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=10000)
    dialog = win.settings_dialog()
    qtbot.addWidget(dialog)
    assert "Auto would pick: fp16" in dialog.estimate.text()
    dialog.context.setValue(1_000_000)  # 1M tokens x 23 KB at fp16 is more than this machine's RAM
    assert "Auto would pick: fp16" not in dialog.estimate.text()
    dialog.context.setValue(4096)
    dialog.precision.setCurrentText("int4")
    dialog.headroom.setValue(0.5)
    dialog.temperature.setValue(0.0)
    model = bridge.engine.loaded.model
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000):
        win.apply_settings(dialog)
    assert bridge.engine.precision.value == "int4" and bridge.engine.config.max_context == 4096
    assert bridge.engine.loaded.model is model and win.sampling.temperature == 0.0
    assert bridge.engine.config.headroom_bytes == 1 << 29
    assert store.setting("engine")["kv_precision"] == "int4" and store.setting("sampling")["temperature"] == 0.0


def test_code_blocks_are_highlighted_and_copied(qtbot, app_parts):
    from PySide6.QtCore import QUrl
    from PySide6.QtGui import QGuiApplication

    win, store, _, _ = app_parts
    win.new_conversation()
    store.add_message(win.conversation_id, "user", "Show me code")
    store.add_message(win.conversation_id, "assistant", "Here:\n\n```python\ndef f():\n    return 1\n```\n\nDone.")
    win.render_chat()
    assert win.code_blocks == ["def f():\n    return 1"]
    assert "style=" in win.chat_view.toHtml() and "Done." in win.chat_view.toPlainText()
    win.on_link(QUrl("copy:0"))
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1"


def test_persona_editor_and_export(qtbot, app_parts, tmp_path):
    win, store, _, _ = app_parts
    win.save_persona(None, "Pirate", "You talk like a pirate.")
    assert win.persona_box.currentText() == "Pirate"
    win.save_persona(None, "Pirate", "duplicate name")  # refused with a message, nothing lost
    assert [p["name"] for p in store.personas()].count("Pirate") == 1
    assert "Could not save" in win.notice_label.text()
    send(qtbot, win, "Hello")
    win.export_to(tmp_path / "chat.md")
    win.export_to(tmp_path / "chat.json")
    assert "You talk like a pirate." in (tmp_path / "chat.md").read_text()
    assert json.loads((tmp_path / "chat.json").read_text())["persona"]["name"] == "Pirate"


def test_an_unreadable_model_path_says_why_and_the_last_model_comes_back(qtbot, app_parts):
    win, store, bridge, tmp_path = app_parts
    dialog = win.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.model.setText(str(tmp_path / "no-such-model"))
    with qtbot.waitSignal(bridge.load_failed, timeout=60000) as failed:
        win.apply_settings(dialog)
    assert "no such model" in failed.args[0]
    back_on_the_starter(qtbot, bridge, store)
    qtbot.waitUntil(lambda: win.load_bar.isHidden(), timeout=10000)
    assert "could not be loaded" in win.notice_label.toolTip() and "model ready" in win.notice_label.text()
    send(qtbot, win, "Hello")
    assert store.messages(win.conversation_id)[-1].content


def test_a_download_shows_progress_and_can_be_cancelled(qtbot, app_parts, monkeypatch):
    import time

    import huggingface_hub

    win, store, bridge, _ = app_parts

    def slow_snapshot(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        bar = tqdm_class(total=3 * 10 ** 9, unit="B", disable=True)  # sizes past 2 GiB must pass the signal
        for _ in range(600):
            bar.update(10 ** 7)
            time.sleep(0.05)
        raise AssertionError("the download was not cancelled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", slow_snapshot)
    dialog = win.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.model.setText("org/tiny")
    win.apply_settings(dialog)
    assert not win.load_bar.isHidden() and not win.cancel_load_button.isHidden()
    qtbot.waitUntil(lambda: win.load_bar.maximum() == 1000 and win.load_bar.value() > 0, timeout=30000)
    assert "/ 3.00 GB" in win.load_bar.format()
    win.input.setPlainText("wait for me")
    win.send()  # refused while loading, and the text stays
    assert win.input.toPlainText() == "wait for me" and "loading" in win.notice_label.text()
    with qtbot.waitSignal(bridge.load_failed, timeout=30000) as failed:
        win.cancel_load_button.click()
    assert failed.args[0] == "download cancelled"
    back_on_the_starter(qtbot, bridge, store)


def test_an_engine_error_becomes_a_message_and_the_next_turn_works(qtbot, app_parts, monkeypatch):
    win, store, bridge, _ = app_parts

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(bridge.engine.runner, "forward", broken)
    send(qtbot, win, "Hello")
    failed = store.messages(win.conversation_id)[-1]
    assert failed.interrupted and "device lost" in failed.content and "device lost" in win.notice_label.text()
    monkeypatch.undo()
    send(qtbot, win, "Hello again")
    last = store.messages(win.conversation_id)[-1]
    assert last.role == "assistant" and last.content and not last.interrupted


def test_a_corrupt_database_at_start_is_reported_and_kept(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "chat.db").write_bytes(b"this is not a database " * 200)
    shown = []
    monkeypatch.setattr(main.QMessageBox, "critical", lambda parent, title, text: shown.append(text))
    assert main.run() == 1
    assert len(shown) == 1 and "damaged" in shown[0]
    backups = [p for p in (tmp_path / "data").iterdir() if p.name != "chat.db"]
    assert backups and backups[0].read_bytes() == b"this is not a database " * 200


def test_delete_asks_with_the_chats_title_and_deletes_only_on_yes(qtbot, app_parts):
    win, store, _, _ = app_parts
    shown(qtbot, win)
    kept = store.create_conversation("Keep me")
    doomed = store.create_conversation("Trip to Lisbon")
    store.add_message(doomed, "user", "Plan three days in Lisbon")
    win.refresh_conversations()
    click_chat(qtbot, win, "Trip to Lisbon")
    assert "Plan three days in Lisbon" in win.chat_view.toPlainText()
    with answering(QMessageBox, press(QMessageBox.Cancel)) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)  # clicked(bool) once filled confirm=False
    assert len(asked) == 1 and "Trip to Lisbon" in asked[0]
    assert chat_ids(Store(store.path)) == {kept, doomed}  # read back from the file
    assert win.conversation_id == doomed and "Plan three days in Lisbon" in win.chat_view.toPlainText()
    with answering(QMessageBox, press(QMessageBox.Yes)) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)
    assert len(asked) == 1 and "Trip to Lisbon" in asked[0]
    assert chat_ids(Store(store.path)) == {kept}
    assert win.conversation_id is None and not win.conversation_list.findItems("Trip to Lisbon", Qt.MatchExactly)


def test_a_chat_clicked_during_a_reply_opens_and_delete_removes_that_one(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    other = store.create_conversation("Older chat")
    store.add_message(other, "user", "An older question")
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    win.input.setPlainText("Write a very long story.")
    with qtbot.waitSignal(bridge.token, timeout=60000):
        qtbot.mouseClick(win.send_button, Qt.LeftButton)
    streaming = win.conversation_id
    click_chat(qtbot, win, "Older chat")
    assert bridge.busy  # the reply still streams, into its own chat
    assert win.conversation_id == other and win.conversation_list.currentItem().text() == "Older chat"
    assert "An older question" in win.chat_view.toPlainText()  # the view followed the highlight
    with answering(QMessageBox, press(QMessageBox.Yes)) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)
    assert len(asked) == 1 and "Older chat" in asked[0]
    assert chat_ids(store) == {streaming}
    click_chat(qtbot, win, "Write a very long story.")
    assert win.conversation_id == streaming and "Write a very long story." in win.chat_view.toPlainText()
    with answering(QMessageBox, press(QMessageBox.Yes)) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)  # refused while its reply streams
    assert not asked and chat_ids(store) == {streaming} and "stop it" in win.notice_label.text()
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=60000)
    reply = store.messages(streaming)[-1]
    assert reply.role == "assistant" and reply.content and reply.interrupted


def test_a_mistyped_model_is_never_saved_and_the_last_model_comes_back(qtbot, app_parts, monkeypatch):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    saved = []
    set_setting = store.set_setting
    monkeypatch.setattr(store, "set_setting", lambda key, value: (saved.append((key, value)), set_setting(key, value)))

    def mistype(dialog):
        dialog.model.clear()
        qtbot.keyClicks(dialog.model, "startr")
        dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.Ok).click()
        return dialog.engine_settings()["model"]

    with qtbot.waitSignal(bridge.load_failed, timeout=60000) as failed:
        with answering(SettingsDialog, mistype) as typed:
            qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert typed == ["startr"] and "no such model: startr" in failed.args[0]
    back_on_the_starter(qtbot, bridge, store)
    qtbot.waitUntil(lambda: "model ready" in win.notice_label.text(), timeout=10000)
    assert [value["model"] for key, value in saved if key == "engine"] in ([], ["starter"])  # never "startr"
    send(qtbot, win, "Hello")
    assert store.messages(win.conversation_id)[-1].content


def test_a_saved_model_that_fails_at_launch_is_reported_not_loading_for_ever(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    Store(tmp_path / "data" / "chat.db").set_setting("engine", {"model": str(tmp_path / "moved-away.gguf")})
    seen = {}

    def event_loop(app):  # main.run's app.exec(): look at the window as the user would, then quit
        win = next(w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible())
        qtbot.waitUntil(lambda: "could not be loaded" in win.notice_label.text(), timeout=10000)
        seen.update(label=win.precision_label.text(), bar=win.load_bar.isVisible(),
                    boxes=[b.text() for b in win.findChildren(QMessageBox) if b.isVisible()])
        win.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", event_loop)
    assert main.run() == 0
    assert "loading" not in seen["label"] and not seen["bar"]
    assert any("no such model file" in text and "Settings" in text for text in seen["boxes"])
