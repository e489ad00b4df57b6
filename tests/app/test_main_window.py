"""The main window on the starter model, offscreen, with a real SQLite file."""
import json

from PySide6.QtCore import QPoint, Qt, QTimer
from PySide6.QtWidgets import QApplication, QDialogButtonBox, QMessageBox

from kvchat.app.controllers.replies import WAITING_NOTE
from kvchat.app.views.main_window import MainWindow
from kvchat.app.views.settings_dialog import SettingsDialog
from kvchat.app.store import Store
from kvchat.core.config import SamplingParams

from kvchat.cli.launcher import local_engine
from qt_helpers import (answering, back_on_the_starter, chat_ids, click_chat, hover, last_stats, press, qml_click,
                        qml_items, send, shown)


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
    stats = last_stats(win)
    assert len(stats) == 1 and "TTFT" in stats[0] and "cached" in stats[0]  # the reply's stats tooltip


def test_stop_keeps_the_partial_reply_marked_interrupted(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    bridge.token.connect(lambda *a: win.stop_button.click())
    send(qtbot, win, "Write a very long story.")
    reply = store.messages(win.conversation_id)[-1]
    assert reply.interrupted and 0 < len(reply.token_ids) < 400


def test_quit_mid_reply_saves_every_word_the_window_showed(qtbot, app_parts, monkeypatch):
    """The periodic save lags the screen; at quit the event loop has stopped, so the engine's
    cancelled end never reaches the window: main.run saves what was shown before closing it."""
    from kvchat.app.controllers import replies

    win, store, bridge, _ = app_parts
    monkeypatch.setattr(replies, "SAVE_EVERY_S", 3600.0)  # the last periodic save: the empty start
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    shown_tokens = []
    bridge.token.connect(lambda text, tid: shown_tokens.append(text))
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(shown_tokens) >= 5, timeout=60000)
    qtbot.waitUntil(lambda: win.replies.text in win.chat_view.toPlainText(), timeout=5000)
    seen = win.replies.text  # no event is delivered from here on, as once the loop has stopped at quit
    win.close()
    win.replies.save_so_far()  # what main.run does once app.exec() returns
    reply = store.messages(win.conversation_id)[-1]
    assert reply.interrupted and reply.content == seen and len(reply.token_ids) >= 5


def test_a_reply_waiting_for_the_warm_up_says_why_and_stop_ends_it_at_once(qtbot, app_parts, monkeypatch):
    """The first reply after a start waits while the decode step compiles (90 s cold here): the
    chat says so under the reply, and Stop does not wait for the compile to end."""
    import threading

    from kvchat.app.controllers.replies import WARMING_NOTE
    from kvchat.engine.host import ModelHost

    compiled = threading.Event()  # the compile ends when the test says so, after the Stop

    def compiling(host):  # the engine's warm-up as the user sees it (its notices: test_decode_step)
        if not host.warmed:
            host.warmed = True
            host.engine.notice("warm-up", "preparing fast decoding (a minute or two the first time, seconds after)")
            compiled.wait(60)
            host.engine.notice("warm-up", "fast decoding ready (4 s)")

    win, store, bridge, _ = app_parts
    monkeypatch.setattr(ModelHost, "warm_decode", compiling)
    bridge.engine.host.warmed = False  # as after a start: the next idle second or request compiles first
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "note")] == [WARMING_NOTE], timeout=5000)
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    assert win.send_button.isEnabled() and not bridge.busy  # now, while the compile still runs
    reply = store.messages(win.conversation_id)[-1]
    assert reply.role == "assistant" and reply.interrupted and reply.content == ""
    assert not qml_items(win, "note") and not compiled.is_set()
    QTimer.singleShot(300, compiled.set)  # while the next message waits behind the compile
    send(qtbot, win, "Name a color.")  # queued behind the compile; the stopped one is skipped
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[-1].content and not messages[-1].interrupted and not qml_items(win, "note")


def test_new_chat_twice_makes_one_empty_chat(qtbot, app_parts):
    win, store, _, _ = app_parts
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    first = win.conversation_id
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    assert win.conversation_id == first and chat_ids(store) == {first}
    send(qtbot, win, "Name a color.")
    qtbot.mouseClick(win.new_button, Qt.LeftButton)  # the first has a message now: a second chat
    assert win.conversation_id != first and len(chat_ids(store)) == 2


def test_regenerate_replaces_the_last_reply_and_edit_resends(qtbot, app_parts):
    win, store, _, _ = app_parts
    send(qtbot, win, "Name a color.")
    first = store.messages(win.conversation_id)[-1]
    win.replies.regenerate()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=60000)
    messages = store.messages(win.conversation_id)
    assert len(messages) == 2 and messages[-1].content == first.content  # greedy: the same reply again
    assert messages[-1].stats["cached_tokens"] > first.stats["cached_tokens"]  # from the prefix cache
    send(qtbot, win, "And another?")
    assert len(store.messages(win.conversation_id)) == 4
    assert len(last_stats(win)) == 2  # a stats tooltip on each reply
    shown(qtbot, win)
    edit = qml_items(win, "editMessage")[0]  # the first message's edit action
    hover(qtbot, win, edit)
    qml_click(qtbot, win, edit)
    assert win.input.toPlainText() == "Name a color." and win.send_button.text() == "Resend"
    win.escape()  # cancels the edit
    assert win.replies.editing is None and not win.input.toPlainText() and win.send_button.text() == "Send"
    qml_click(qtbot, win, qml_items(win, "editMessage")[0])
    send(qtbot, win, "Name a fruit.")
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant"] and messages[0].content == "Name a fruit."
    assert messages[1].content and win.send_button.text() == "Send"
    assert not win.notice_label.text().startswith("editing")  # the edit is over


def test_gauge_receives_snapshots_and_precision_changes_without_reload(qtbot, app_parts):
    win, _, bridge, _ = app_parts
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=10000)
    assert win.gauge.snapshot["on_cpu"] and "on the CPU" in win.precision_label.text()
    from kvchat.app.views.gauge import segments

    parts = dict((label, size) for label, size, _ in segments(win.gauge.snapshot))
    assert sum(parts.values()) == win.gauge.snapshot["total"]  # the bar accounts for every byte
    assert parts["KV in use"] + parts["prefix cache"] + parts["KV free"] == win.gauge.snapshot["kv_total"]
    model = bridge.engine.loaded.model
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000) as got:
        bridge.reconfigure(1024, "int8")
    assert got.args[0]["kv_precision"] == "int8" and bridge.engine.loaded.model is model
    send(qtbot, win, "Hi again")
    assert last_stats(win)[-1].endswith("KV int8")  # the newest reply's stats


def test_conversations_survive_a_restart_and_empty_input_sends_nothing(qtbot, app_parts):
    win, store, bridge, tmp_path = app_parts
    send(qtbot, win, "Remember me")
    win.input.setPlainText("   ")
    win.replies.send()
    assert len(store.messages(win.conversation_id)) == 2
    win.close()
    again = MainWindow(Store(tmp_path / "chat.db"), bridge)  # a new connection, as after a restart
    qtbot.addWidget(again)
    assert [i.text() for i in again.conversation_list.chat_items()] == ["Remember me"]
    assert again.conversation_list.headings() == ["Today"]
    shown(qtbot, again)
    click_chat(qtbot, again, "Remember me")
    assert "Remember me" in again.chat_view.toPlainText()


def test_settings_show_the_planner_live_and_apply_without_reload(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=10000)
    dialog = win.models.settings_dialog()
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
        win.models.apply_settings(dialog)
    assert bridge.engine.precision.value == "int4" and bridge.engine.config.max_context == 4096
    assert bridge.engine.loaded.model is model and win.sampling.temperature == 0.0
    assert bridge.engine.config.headroom_bytes == 1 << 29
    assert store.setting("engine")["kv_precision"] == "int4" and store.setting("sampling")["temperature"] == 0.0


def test_code_blocks_show_their_language_and_copy(qtbot, app_parts):
    from PySide6.QtGui import QGuiApplication

    win, store, _, _ = app_parts
    shown(qtbot, win)
    win.chats.new()
    store.add_message(win.conversation_id, "user", "Show me code\nin Python")
    store.add_message(win.conversation_id, "assistant", "Here:\n\n```python\ndef f():\n    return 1\n```\n\n"
                                                         "# not a title\n\nDone.")
    win.render_chat()
    qtbot.waitUntil(lambda: len(qml_items(win, "codeBlock")) == 1, timeout=5000)
    assert [i.property("text") for i in qml_items(win, "codeLanguage")] == ["python"]
    assert "<span" in qml_items(win, "codeText")[0].property("text")  # highlighted
    user_text = qml_items(win, "messageText")[0]
    assert user_text.property("text") == "Show me code\nin Python"  # the newline the user typed stays
    assert any("### not a title" in i.property("text") for i in qml_items(win, "messageText"))
    QGuiApplication.clipboard().clear()
    qml_click(qtbot, win, qml_items(win, "copyCode")[0])
    assert QGuiApplication.clipboard().text() == "def f():\n    return 1"
    assert qml_items(win, "copyCode")[0].property("text") == "Copied"


def test_a_long_code_line_wraps_inside_its_block(qtbot, app_parts):
    """It ran past the block's right edge (a <pre> does not wrap)."""
    win, store, _, _ = app_parts
    shown(qtbot, win)
    win.chats.new()
    store.add_message(win.conversation_id, "user", "code")
    line = "x = 1  # " + "a long comment " * 30
    store.add_message(win.conversation_id, "assistant", f"```python\n{line}\n```")
    win.render_chat()
    qtbot.waitUntil(lambda: len(qml_items(win, "codeText")) == 1, timeout=5000)
    code = qml_items(win, "codeText")[0]
    qtbot.waitUntil(lambda: code.property("contentHeight") > 0, timeout=5000)
    assert code.property("contentWidth") <= code.property("width")
    assert code.property("lineCount") > 1


def test_persona_editor_and_export(qtbot, app_parts, tmp_path):
    win, store, _, _ = app_parts
    win.personas.save(None, "Pirate", "You talk like a pirate.")
    assert win.persona_box.currentText() == "Pirate"
    win.personas.save(None, "Pirate", "duplicate name")  # refused with a message, nothing lost
    assert [p["name"] for p in store.personas()].count("Pirate") == 1
    assert "Could not save" in win.notice_label.text()
    send(qtbot, win, "Hello")
    win.chats.export_to(tmp_path / "chat.md")
    win.chats.export_to(tmp_path / "chat.json")
    assert "You talk like a pirate." in (tmp_path / "chat.md").read_text()
    assert json.loads((tmp_path / "chat.json").read_text())["persona"]["name"] == "Pirate"


def test_an_unreadable_model_path_says_why_and_the_last_model_comes_back(qtbot, app_parts):
    win, store, bridge, tmp_path = app_parts
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.model.setText(str(tmp_path / "no-such-model"))
    with qtbot.waitSignal(bridge.load_failed, timeout=60000) as failed:
        win.models.apply_settings(dialog)
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
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.model.setText("org/tiny")
    win.models.apply_settings(dialog)
    assert not win.load_bar.isHidden() and not win.cancel_load_button.isHidden()
    qtbot.waitUntil(lambda: win.load_bar.maximum() == 1000 and win.load_bar.value() > 0, timeout=30000)
    assert "/ 3.00 GB" in win.load_bar.format()
    win.input.setPlainText("wait for me")
    qtbot.keyClick(win.input, Qt.Key_Return)  # queued while loading, with a note in the chat
    assert not win.input.toPlainText() and store.messages(win.conversation_id)[-1].content == "wait for me"
    assert [i.property("text") for i in qml_items(win, "note")] == [WAITING_NOTE]
    assert "answered when it is ready" in win.notice_label.text()
    with qtbot.waitSignal(bridge.load_failed, timeout=30000) as failed:
        win.cancel_load_button.click()
    assert "cancelled" in failed.args[0]
    back_on_the_starter(qtbot, bridge, store)
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and len(store.messages(win.conversation_id)) == 2,
                    timeout=60000)
    reply = store.messages(win.conversation_id)[-1]
    assert reply.role == "assistant" and reply.content and not qml_items(win, "note")


def test_an_engine_error_becomes_a_message_and_the_next_turn_works(qtbot, app_parts, monkeypatch):
    win, store, bridge, _ = app_parts

    def broken(*args, **kwargs):
        raise RuntimeError("device lost")

    monkeypatch.setattr(bridge.engine.kvpool.runner, "forward", broken)
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
    assert main.run(local_engine) == 1
    assert len(shown) == 1 and "damaged" in shown[0]
    backups = [p for p in (tmp_path / "data").iterdir() if p.name != "chat.db"]
    assert backups and backups[0].read_bytes() == b"this is not a database " * 200


def test_delete_asks_with_the_chats_title_and_deletes_only_on_yes(qtbot, app_parts):
    win, store, _, _ = app_parts
    shown(qtbot, win)
    kept = store.create_conversation("Keep me")
    doomed = store.create_conversation("Trip to Lisbon")
    store.add_message(doomed, "user", "Plan three days in Lisbon")
    win.chats.refresh()
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
    assert "stop it" not in win.notice_label.text()  # no longer true: the reply has ended


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
    assert main.run(local_engine) == 0
    assert "loading" not in seen["label"] and not seen["bar"]
    assert any("no such model file" in text and "Settings" in text for text in seen["boxes"])


def test_the_app_imports_no_torch_before_its_window_shows():
    """The window's modules leave torch and transformers to the engine's worker thread: imported
    with them, the window waited 4 s for any frame."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import kvchat.cli.launcher, kvchat.app.main, kvchat.app.views.main_window, kvchat.app.controllers.engine_bridge\n"
            "print(sorted(m for m in ('torch', 'transformers', 'kvchat.engine.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_window_works_before_the_engine_exists_and_takes_it_over(qtbot, tmp_path, engine_model):
    """The engine is made on a worker thread after the window shows: until then the window says it
    is loading, a message waits for the model, and a context change is kept for the engine."""
    import threading

    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.core.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.model.loading import LoadedModel

    imported = threading.Event()  # stands for the seconds torch and transformers take to import
    made = []

    def make(config):
        assert imported.wait(60)
        made.append(Engine(config, loaded=LoadedModel(**vars(engine_model)), persona_store=None))
        return made[0]

    starter = EngineStarter(EngineConfig(max_context=512), make)
    bridge = EngineBridge(starter)
    store = Store(tmp_path / "chat.db")
    win = MainWindow(store, bridge, SamplingParams(max_new_tokens=8, temperature=0))
    qtbot.addWidget(win)
    shown(qtbot, win)
    starter.start()
    try:
        assert win.load_bar.isVisible() and win.model_chip.text() == "loading…"
        win.input.setPlainText("Hello")
        qtbot.keyClick(win.input, Qt.Key_Return)
        assert [i.property("text") for i in qml_items(win, "note")] == [WAITING_NOTE]
        changed = starter.reconfigure(max_context=384)  # kept until the engine exists
        assert not changed.done() and not made
        imported.set()
        qtbot.waitUntil(lambda: len(store.messages(win.conversation_id)) == 2 and win.send_button.isEnabled(),
                        timeout=60000)
        assert store.messages(win.conversation_id)[-1].content and not win.load_bar.isVisible()
        assert changed.result(30)["max_context"] == 384 and starter.config.max_context == 384
        assert starter.loaded is made[0].loaded and not qml_items(win, "note")
    finally:
        imported.set()
        starter.close()


def test_an_engine_that_cannot_be_made_is_reported_like_a_failed_load(qtbot, tmp_path):
    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.core.config import EngineConfig

    def broken(config):
        raise ImportError("libtorch_cpu.so: cannot open shared object file")

    starter = EngineStarter(EngineConfig(), broken)
    win = MainWindow(Store(tmp_path / "chat.db"), EngineBridge(starter))
    qtbot.addWidget(win)
    with qtbot.waitSignal(win.bridge.load_failed, timeout=10000) as failed:
        starter.start()
    assert "engine could not start" in failed.args[0] and "libtorch_cpu" in failed.args[0]
    qtbot.waitUntil(lambda: "no model" in win.model_chip.text(), timeout=5000)
    assert not win.load_bar.isVisible()


def test_launch_shows_the_window_before_making_the_engine(qtbot, tmp_path, monkeypatch):
    from kvchat.app import main
    from kvchat.app.controllers.engine_starter import EngineStarter
    from kvchat.app.controllers.replies import ReplyController

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    order = []
    monkeypatch.setattr(EngineStarter, "start", lambda self: order.append(
        any(w.isVisible() for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow))) or self)

    def event_loop(app):
        qtbot.waitUntil(lambda: bool(order), timeout=5000)
        for w in QApplication.topLevelWidgets():
            w.close()
        return 0

    monkeypatch.setattr(QApplication, "exec", event_loop)
    monkeypatch.setattr(ReplyController, "save_so_far", lambda self: order.append("saved"))
    assert main.run(local_engine) == 0
    assert order == [True, "saved"]  # one engine, made once the window was on screen; the reply saved at quit


def test_a_gguf_conversion_moves_the_load_bar_tensor_by_tensor(qtbot, app_parts, tmp_path, monkeypatch):
    """A fresh cache: while there is no count (reading the file, making the tokenizer and the
    model) the bar is busy and the label beside it says which; then it counts the tensors up to
    all; then the weights loaded."""
    import gguf

    from kvchat.core.model_source import starter_path

    win, store, bridge, _ = app_parts
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "fresh"))
    model = tmp_path / "smollm2.gguf"
    model.symlink_to(starter_path())
    n = len(gguf.GGUFReader(model).tensors)
    seen = []  # what the user sees after each progress event (the window's slot runs first)
    bridge.load_progress.connect(lambda *_: seen.append((win.load_bar.value(), win.load_bar.maximum(),
                                                         win.load_bar.text(), win.precision_label.text())))
    win.models.load_model({"model": str(model)}, previous=None)
    qtbot.waitUntil(lambda: not bridge.switching, timeout=150000)
    assert bridge.load_error is None
    busy = [label for _, maximum, text, label in seen if maximum == 0]
    assert busy == ["reading GGUF file…", "converting GGUF: the tokenizer…", "converting GGUF: building the model…"]
    assert all(not text for _, maximum, text, _ in seen[:3])  # a busy bar draws no text: the label has it
    converting = [s for s in seen if s[2].startswith("converting")]
    counted = [value for value, maximum, _, _ in converting if maximum == n]
    assert counted == sorted(counted) and counted[-1] == n and len(set(counted)) > n // 2
    assert f"tensor {n} of {n}" in converting[-1][2] and converting[-1][3] == "converting GGUF…"
    loading = seen[3 + len(converting):]  # then the weights, each tensor of the converted model
    assert loading and all(s[2].startswith("loading weights") for s in loading)
    assert [s[0] for s in loading] == sorted(s[0] for s in loading) and loading[-1][0] == loading[-1][1] > 0
    assert win.load_bar.isHidden() and win.precision_label.text().startswith("KV ")  # ready


def top_bar_widgets(win):
    row = win.top_bar.layout()
    return [row.itemAt(i).widget() for i in range(row.count()) if row.itemAt(i).widget() is not None]


def test_a_narrow_window_keeps_the_persona_badge_whole(qtbot, app_parts):
    """At 1000 px the chips' minimum held the window at 1056 px and, forced narrower, the badge was
    cut ("warm (in memo"): now the KV and context chips give way, and come back when there is room."""
    win, _, _, _ = app_parts
    win.personas.asker.answered.emit(win.persona_box.currentData(), "warm")  # the longest state the engine gives
    assert win.persona_badge.text() == "warm (in memory)"
    win.resize(1000, 700)
    qtbot.waitUntil(lambda: win.width() == 1000 and win.kv_chip.isHidden() and win.context_chip.isHidden())
    badge = win.persona_badge
    qtbot.waitUntil(lambda: badge.width() >= badge.sizeHint().width())
    shown = [w for w in top_bar_widgets(win) if w.isVisible()]
    for left, right in zip(shown, shown[1:]):  # side by side, none drawn over another
        assert left.geometry().right() < right.geometry().left()
    assert shown[-1].geometry().right() < win.top_bar.width()
    assert win.model_chip.width() >= 160  # elided, still readable
    assert "KV" in win.precision_label.text()  # the status bar still names the precision
    win.resize(1600, 1000)
    qtbot.waitUntil(lambda: win.kv_chip.isVisible() and win.context_chip.isVisible())
    assert win.model_chip.width() == win.model_chip.sizeHint().width()  # the whole name


def test_the_model_chip_counts_the_parameters_as_the_library_does(qtbot, tmp_path):
    """int8 weights (the CPU's 'auto') give the tied head its own copy and untie the config, which
    then counted the embedding twice: the chip read 163M, the library 135M for the same starter."""
    from kvchat.app.controllers.engine_bridge import EngineBridge
    from kvchat.core.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.core.model_source import starter_path

    engine = Engine(EngineConfig(max_context=512, weights="int8"), persona_store=None)
    bridge = EngineBridge(engine, lambda settings: None)
    win = shown(qtbot, MainWindow(Store(tmp_path / "chat.db"), bridge, SamplingParams(max_new_tokens=4)))
    qtbot.addWidget(win)
    try:
        qtbot.waitUntil(lambda: "weights" in win.model_chip.text(), timeout=120000)
        assert engine.loaded.model.config.tie_word_embeddings is False  # the case that read 163M
        folder = tmp_path / "models"
        folder.mkdir()
        (folder / "smollm2.gguf").symlink_to(starter_path())
        library = win.models.library(roots=[(folder, "here")])
        qtbot.addWidget(library)
        library.show()
        qtbot.waitUntil(lambda: library.table.rowCount() == 1, timeout=30000)
        in_library = library.table.item(0, 3).text()
        assert in_library == "135M" and win.model_chip.text().split(" · ")[1] == in_library
    finally:
        engine.close()


def test_the_load_bar_stays_put_while_the_stage_beside_it_changes(qtbot, app_parts):
    """The stage label's text grows and shrinks from stage to stage; the bar must not jump sideways."""
    win, _, bridge, _ = app_parts
    win.show()
    win.models.set_loading(True)
    edges = []
    for done, total, stage in ((0, 0, "read"), (0, 0, "tokenizer"), (0, 0, "model"), (5, 272, "convert"),
                               (272, 272, "convert"), (9, 272, "weights")):
        bridge.load_progress.emit(done, total, stage)
        qtbot.wait(30)  # the layout runs on the next turn of the event loop
        left = win.load_bar.mapTo(win, QPoint(0, 0)).x()
        edges.append((left, left + win.load_bar.width()))
    assert len(set(edges)) == 1, edges
