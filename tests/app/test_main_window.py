"""The main window offscreen, on the fake backend (tests/support), with a real SQLite file; the same
paths on a real engine: test_end_to_end.py."""
import json
import re

import pytest

from PySide6.QtCore import Qt

from kvchat.app.controllers.replies import WAITING_NOTE
from kvchat.app.views.main_window import MainWindow
from kvchat.app.views.settings_dialog import SettingsDialog
from kvchat.app.views.sheet import Question
from kvchat.app.store import Store
from kvchat.core.commands import LoadModel
from kvchat.core.config import SamplingParams

from qt_helpers import (answering, back_on_the_starter, chat_ids, click_chat, hover, last_stats, no, qml_click,
                        qml_items, send, settled, shown, yes)


def test_quit_mid_reply_saves_every_word_the_window_showed(qtbot, app_parts, monkeypatch):
    """The periodic save lags the screen; at quit the event loop has stopped, so the engine's
    cancelled end never reaches the window: main.run saves what was shown before closing it."""
    from kvchat.app.controllers import replies

    win, store, bridge, _ = app_parts
    monkeypatch.setattr(replies, "SAVE_EVERY_S", 3600.0)  # the last periodic save: the empty start
    win.sampling = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
    shown_tokens = []
    bridge.token.connect(lambda key, text, tid: shown_tokens.append(text))
    bridge.engine.pace.hold()
    bridge.engine.pace.give(5)  # five tokens, then the reply waits as a slow model would
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(shown_tokens) == 5, timeout=10000)
    qtbot.waitUntil(lambda: win.replies.shown.text in win.chat_view.toPlainText(), timeout=5000)
    seen = win.replies.shown.text  # no event is delivered from here on, as once the loop has stopped at quit
    win.close()
    win.replies.save_so_far()  # what main.run does once app.exec() returns
    reply = store.messages(win.conversation_id)[-1]
    assert reply.interrupted and reply.content == seen == "".join(shown_tokens) and len(reply.token_ids) == 5


def test_a_reply_waiting_for_the_warm_up_says_why_and_stop_ends_it_at_once(qtbot, app_parts):
    """The first reply after a start waits while the decode step compiles (90 s cold here): the
    chat says so under the reply, and Stop does not wait for the compile to end."""
    from kvchat.app.controllers.wait_notes import WARMING_NOTE

    win, store, bridge, _ = app_parts
    compiled = bridge.engine.warm_up()  # the compile ends when the test says so, after the Stop
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "note")] == [WARMING_NOTE], timeout=5000)
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    assert win.send_button.isEnabled() and not bridge.busy  # now, while the compile still runs
    assert [m.role for m in store.messages(win.conversation_id)] == ["user"]  # no empty "interrupted" reply
    assert not qml_items(win, "note") and not compiled.is_set()
    win.input.setPlainText("Name a color.")
    qtbot.keyClick(win.input, Qt.Key_Return)  # queued behind the compile; the stopped one is skipped
    assert not win.send_button.isEnabled() and not compiled.is_set()
    # the capture still runs: the new reply says so too (the stop did not end the warm-up)
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "note")] == [WARMING_NOTE], timeout=5000)
    compiled.set()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "user", "assistant"]
    assert messages[-1].content and not messages[-1].interrupted and not qml_items(win, "note")


def test_a_decode_step_compiled_in_the_background_keeps_no_reply_waiting_note(qtbot, app_parts):
    """On the CPU the step compiles on a thread of its own while the reply decodes eagerly: the chat
    must not say the reply starts after it."""
    win, store, bridge, _ = app_parts
    bridge.engine.warm_up(background=True)
    bridge.engine.pace.hold()  # the reply's first token is the test's to give
    notices = []
    bridge.notice.connect(lambda kind, message: notices.append(kind))
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: notices == ["warm-up"], timeout=5000)
    assert bridge.busy and not win.chat_view.model.rows[-1].get("note") and not qml_items(win, "note")
    bridge.engine.pace.free()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    assert store.messages(win.conversation_id)[-1].content == "Hello! How can I help you today?"


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
    model = bridge.engine.model
    with qtbot.waitSignal(bridge.reconfigured, timeout=60000) as got:
        bridge.reconfigure(1024, "int8")
    assert got.args[0]["kv_precision"] == "int8" and bridge.engine.model is model  # not reloaded
    assert (bridge.engine.config.max_context, bridge.engine.precision.value) == (1024, "int8")
    qtbot.waitUntil(lambda: win.gauge.snapshot["precision"] == "int8", timeout=5000)
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


def loads(bridge):
    settled(bridge)
    return sum(isinstance(c, LoadModel) for c in bridge.engine.commands_seen)


def test_an_unreadable_model_path_says_why_and_the_model_in_use_stays_loaded(qtbot, app_parts):
    """Checked before the switch: the model in use is never unloaded for a path that is not there."""
    win, store, bridge, tmp_path = app_parts
    before = loads(bridge)
    dialog = win.models.settings_dialog()
    qtbot.addWidget(dialog)
    dialog.model.setText(str(tmp_path / "no-such-model"))
    win.models.apply_settings(dialog)
    assert "no such model" in win.notice_label.text() and "current model stays" in win.notice_label.text()
    assert not bridge.loading and win.load_bar.isHidden() and loads(bridge) == before
    send(qtbot, win, "Hello")
    assert store.messages(win.conversation_id)[-1].content


def test_a_download_shows_progress_and_can_be_cancelled(qtbot, app_parts, monkeypatch):
    import threading

    import huggingface_hub

    win, store, bridge, _ = app_parts
    clicked = threading.Event()

    def slow_snapshot(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        bar = tqdm_class(total=3 * 10 ** 9, unit="B", disable=True)  # sizes past 2 GiB must pass the signal
        bar.update(10 ** 7)
        assert clicked.wait(60)  # the download goes on until the user has clicked Cancel
        bar.update(10 ** 7)  # where a download sees the cancel: at its next chunk
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
        clicked.set()
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

    monkeypatch.setattr(bridge.engine.model, "forward", broken)
    send(qtbot, win, "Hello")
    failed = store.messages(win.conversation_id)[-1]
    assert failed.interrupted and "device lost" in failed.content and "device lost" in win.notice_label.text()
    monkeypatch.undo()
    send(qtbot, win, "Hello again")
    last = store.messages(win.conversation_id)[-1]
    assert last.role == "assistant" and last.content and not last.interrupted


def test_delete_asks_with_the_chats_title_and_deletes_only_on_yes(qtbot, app_parts):
    win, store, _, _ = app_parts
    shown(qtbot, win)
    kept = store.create_conversation("Keep me")
    doomed = store.create_conversation("Trip to Lisbon")
    store.add_message(doomed, "user", "Plan three days in Lisbon")
    win.chats.refresh()
    click_chat(qtbot, win, "Trip to Lisbon")
    assert "Plan three days in Lisbon" in win.chat_view.toPlainText()
    with answering(Question, no) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)  # clicked(bool) once filled confirm=False
    assert len(asked) == 1 and "Trip to Lisbon" in asked[0]
    assert chat_ids(Store(store.path)) == {kept, doomed}  # read back from the file
    assert win.conversation_id == doomed and "Plan three days in Lisbon" in win.chat_view.toPlainText()
    with answering(Question, yes) as asked:
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
    bridge.engine.pace.hold()
    bridge.engine.pace.give(1)  # one token, then the reply streams on, slowly, until Stop
    win.input.setPlainText("Write a very long story.")
    with qtbot.waitSignal(bridge.token, timeout=60000):
        qtbot.mouseClick(win.send_button, Qt.LeftButton)
    streaming = win.conversation_id
    click_chat(qtbot, win, "Older chat")
    assert bridge.busy  # the reply still streams, into its own chat
    assert win.conversation_id == other and win.conversation_list.currentItem().text() == "Older chat"
    assert "An older question" in win.chat_view.toPlainText()  # the view followed the highlight
    with answering(Question, yes) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)
    assert len(asked) == 1 and "Older chat" in asked[0]
    assert chat_ids(store) == {streaming}
    click_chat(qtbot, win, "Write a very long story.")
    assert win.conversation_id == streaming and "Write a very long story." in win.chat_view.toPlainText()
    with answering(Question, yes) as asked:
        qtbot.mouseClick(win.delete_button, Qt.LeftButton)  # refused while its reply streams
    assert not asked and chat_ids(store) == {streaming} and "stop it" in win.notice_label.text()
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=60000)
    reply = store.messages(streaming)[-1]
    assert reply.role == "assistant" and reply.content and reply.interrupted
    assert "stop it" not in win.notice_label.text()  # no longer true: the reply has ended


def test_a_mistyped_model_fails_at_once_and_the_model_in_use_stays(qtbot, app_parts, monkeypatch):
    """It failed only after the model in use was unloaded and loaded again (about 4 minutes on a busy
    machine): the name is now checked before the engine is asked for anything."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    saved = []
    set_setting = store.set_setting
    monkeypatch.setattr(store, "set_setting", lambda key, value: (saved.append((key, value)), set_setting(key, value)))
    before = loads(bridge)

    def mistype(dialog):
        dialog.model.clear()
        qtbot.keyClicks(dialog.model, "startr")
        dialog.save_button.click()
        return dialog.engine_settings()["model"]

    with answering(SettingsDialog, mistype) as typed:
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert typed == ["startr"] and "no such model: startr" in win.notice_label.text()
    assert not bridge.loading and loads(bridge) == before  # the engine was not asked to unload anything
    assert [value["model"] for key, value in saved if key == "engine"] == []  # never "startr"
    send(qtbot, win, "Hello")
    assert store.messages(win.conversation_id)[-1].content


def top_bar_widgets(win):
    row = win.top_bar.layout()
    return [row.itemAt(i).widget() for i in range(row.count()) if row.itemAt(i).widget() is not None]


def test_a_narrow_window_keeps_the_persona_badge_whole(qtbot, app_parts):
    """At 1000 px the chips' minimum held the window at 1056 px and, forced narrower, the badge was
    cut; then the KV and context chips vanished, and with the memory panel open the model chip read
    "Smo…uto" (issue 29). Now the chips first say less, then go into the overflow menu, whose entries
    open their settings; no chip is cut."""
    from kvchat.app.views.settings_dialog import SettingsDialog

    from qt_helpers import answering

    win, _, _, _ = app_parts
    win.personas.asker.answered.emit(win.persona_box.currentData(), "disk")  # the longest state the engine gives
    assert win.persona_badge.text() == "ready, saved on disk"
    qtbot.waitUntil(lambda: "SmolLM2" in win.model_chip.text(), timeout=10000)

    def whole(chip):  # its text drawn in full, or cut at its end: never in the middle ("Smo…uto")
        drawn = chip.drawn_text()
        return chip.isHidden() or drawn == chip.text() or (drawn.endswith("…") and chip.text().startswith(drawn[:-1]))

    def in_menu():
        win.more_button.menu().aboutToShow.emit()
        return [a.text() for a in win.more_button.menu().actions()]

    for width, panel in ((1000, False), (1200, True), (1600, True)):  # 1200: the window opens at it
        win.resize(width, 700)
        if win.memory_button.isChecked() != panel:
            qtbot.mouseClick(win.memory_button, Qt.LeftButton)
        qtbot.waitUntil(lambda: win.width() == width)
        badge = win.persona_badge
        qtbot.waitUntil(lambda: badge.width() >= badge.sizeHint().width())
        shown = [w for w in top_bar_widgets(win) if w.isVisible()]
        for left, right in zip(shown, shown[1:]):  # side by side, none drawn over another
            assert left.geometry().right() < right.geometry().left()
        assert shown[-1].geometry().right() < win.top_bar.width()
        assert all(whole(chip) for chip in (win.model_chip, win.context_chip, win.kv_chip)), width
        hidden = [getattr(w, "full", "") or w.toolTip() for w in win.top_bar.optional if w.isHidden()]
        assert win.more_button.isVisible() == bool(hidden) and in_menu() == hidden  # nothing vanishes
    qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.model_chip.text() == win.model_chip.full)  # room again: the whole text
    assert win.kv_chip.isVisible() and win.context_chip.isVisible() and win.more_button.isHidden()
    win.resize(1000, 700)
    qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.width() == 1000)
    if in_menu():  # an entry of the menu opens its setting, as the chip does
        with answering(SettingsDialog, lambda d: d.reject() or True) as got:
            win.more_button.menu().actions()[0].trigger()
        assert got == [True]


def test_the_running_button_opens_a_chat_the_search_hides_and_the_list_marks_none(qtbot, app_parts):
    """Two chats with replies running (the fake serves them one after the other); the list filtered
    to the second; the button opens the first: no other chat stays highlighted, and a click on the
    second opens it again."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    bridge.engine.pace.hold()  # no token comes: both replies stay running
    send_keys = lambda text: (win.input.setPlainText(text), qtbot.keyClick(win.input, Qt.Key_Return))  # noqa: E731
    send_keys("Tell me about Lisbon")
    first = win.conversation_id
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    send_keys("Tell me about Porto")
    second = win.conversation_id
    assert win.running_button.text() == "2 replies running" and win.stop_button.isVisible()
    qtbot.keyClicks(win.search, "Porto")
    qtbot.waitUntil(lambda: [i.text() for i in win.conversation_list.chat_items()] == ["Tell me about Porto"])
    qtbot.mouseClick(win.running_button, Qt.LeftButton)
    assert win.conversation_id == first and win.conversation_list.currentItem() is None
    assert "Lisbon" in win.chat_view.toPlainText() and win.stop_button.isVisible()
    click_chat(qtbot, win, "Tell me about Porto")
    assert win.conversation_id == second
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)  # ends at once: nothing streamed yet
    assert win.running_button.text() == "1 reply running" and not win.stop_button.isVisible()
    qtbot.mouseClick(win.running_button, Qt.LeftButton)
    assert win.conversation_id == first
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    assert not bridge.busy and not win.running_button.isVisible()
    assert [m.role for m in store.messages(first)] == [m.role for m in store.messages(second)] == ["user"]


def test_a_long_notice_ends_in_an_ellipsis_beside_the_status_not_cut_under_it(qtbot, app_parts):
    """At 1,000 px a notice longer than its room is drawn up to an ellipsis, ending before the
    precision label; the line itself and its tooltip stay whole, and the window does not widen."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    win.resize(1000, 700)
    qtbot.waitUntil(lambda: win.width() == 1000)
    message = "Not sent: an attachment is longer than the context. " * 3
    win.notify(message)
    label = win.notice_label
    qtbot.waitUntil(lambda: label.shown_text() != message)
    assert label.text() == message and message in label.toolTip() and win.width() == 1000
    assert label.shown_text().endswith("…") and message.startswith(label.shown_text()[:-1])
    assert label.fontMetrics().horizontalAdvance(label.shown_text()) <= label.contentsRect().width()
    assert label.geometry().right() < win.precision_label.geometry().left()
    win.notify("ready")
    assert label.shown_text() == "ready"


@pytest.mark.slow
def test_the_background_compile_shows_its_time_so_far_until_it_is_ready(qtbot, app_parts):
    """The engine's warm-up notice says what the compile took here the last time; the notice line
    then counts the time so far each second, and stops at "ready" (another notice meanwhile stays)."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    started = ("preparing fast decoding in the background: replies start at once, faster when it is "
               "ready (it took 2 min here the last time)")
    bridge.notice.emit("warm-up", started)
    assert win.notice_label.text() == f"warm-up: {started}"
    # the count is the time since the notice, shown each second: on a busy machine a second's tick
    # may come late and the line skip a second, so the test waits for counts, not for exact ones
    count = lambda: re.match(r"warm-up: 0:(\d\d) so far · ", win.notice_label.text())
    counted = lambda: int(count().group(1)) if count() else 0
    qtbot.waitUntil(lambda: counted() >= 1, timeout=10000)
    first = counted()
    assert win.notice_label.text() == f"warm-up: 0:{first:02d} so far · {started}"  # a narrow line elides its end
    qtbot.waitUntil(lambda: counted() > first, timeout=10000)
    win.notify("a reply is being written in this chat")  # another notice: not overwritten by the count
    qtbot.wait(1200)
    assert win.notice_label.text() == "a reply is being written in this chat"
    bridge.notice.emit("warm-up", "fast decoding ready (131 s)")
    assert win.notice_label.text() == "warm-up: fast decoding ready (131 s)"
    assert not win.compile_ticker.timer.isActive()
