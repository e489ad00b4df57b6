"""A reply's history, through the window's controls on the fake backend: the persona that wrote it,
the versions regenerate keeps, and replies stopped before their first word (none is kept)."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QPushButton

from kvchat.app.controllers.replies import SEND_AFTER_STOP
from kvchat.app.views.persona_dialog import PersonaDialog
from kvchat.app.views.settings_dialog import SettingsDialog
from kvchat.app.views.sheet import Question
from kvchat.core.commands import LoadModel, Submit

from qt_helpers import answering, click_chat, held_reply, hover, no, qml_click, qml_items, send, shown, yes


def authors(win):
    return [i.property("text") for i in qml_items(win, "author")]


def pick_persona(qtbot, win, name):
    """The persona box as a user works it: open it, click the entry."""
    box = win.persona_box
    box.showPopup()
    view = box.view()
    index = box.model().index(box.findText(name), 0)
    qtbot.mouseClick(view.viewport(), Qt.LeftButton, pos=view.visualRect(index).center())
    qtbot.waitUntil(lambda: box.currentText() == name)


def test_a_reply_keeps_the_persona_that_wrote_it(qtbot, app_parts):
    win, store, _, _ = app_parts
    send(qtbot, win, "Name a color.")
    pick_persona(qtbot, win, "Tutor")
    qtbot.waitUntil(lambda: authors(win) == ["Assistant"])  # picking a persona does not relabel the past
    send(qtbot, win, "And another?")
    qtbot.waitUntil(lambda: authors(win) == ["Assistant", "Tutor"])

    def rename(dialog):
        dialog.name.setText("Patient tutor")
        dialog.save_button.click()

    with answering(PersonaDialog, rename) as renamed:
        qtbot.mouseClick(win.persona_edit_button, Qt.LeftButton)
    assert renamed
    qtbot.waitUntil(lambda: win.persona_box.currentText() == "Patient tutor")
    assert authors(win) == ["Assistant", "Tutor"]  # renaming changes only what comes next
    send(qtbot, win, "Name a fruit.")
    qtbot.waitUntil(lambda: authors(win) == ["Assistant", "Tutor", "Patient tutor"])
    replies = [m for m in store.messages(win.conversation_id) if m.role == "assistant"]
    assert [m.author for m in replies] == ["Assistant", "Tutor", "Patient tutor"]
    assert replies[1].author_hash == replies[2].author_hash != replies[0].author_hash  # same prompt, renamed


def test_a_persona_is_deleted_from_its_button_and_its_replies_keep_its_name(qtbot, app_parts):
    win, store, _, tmp_path = app_parts
    pick_persona(qtbot, win, "Writing coach")
    send(qtbot, win, "Name a color.")
    chat = win.conversation_id

    def delete(dialog):
        dialog.findChild(QPushButton, "deletePersona").click()

    # from the persona's editor: the top bar has no room for another button
    with answering(Question, no) as asked, answering(PersonaDialog, delete):
        qtbot.mouseClick(win.persona_edit_button, Qt.LeftButton)
    assert "Writing coach" in asked[0] and "Writing coach" in [p["name"] for p in store.personas()]
    with answering(Question, yes), answering(PersonaDialog, delete):
        qtbot.mouseClick(win.persona_edit_button, Qt.LeftButton)
    assert "Writing coach" not in [p["name"] for p in store.personas()]
    assert [win.persona_box.itemText(i) for i in range(win.persona_box.count())] == [
        "Assistant", "Code reviewer", "Tutor"]
    messages = store.messages(chat)
    assert [m.content for m in messages][0] == "Name a color." and messages[1].content
    assert messages[1].author == "Writing coach" and authors(win) == ["Writing coach"]
    win.chats.export_to(tmp_path / "chat.md")
    assert "## Writing coach" in (tmp_path / "chat.md").read_text()


def submits(bridge):
    return sum(isinstance(c, Submit) for c in bridge.engine.commands_seen)


def test_regenerate_keeps_versions_and_switching_them_computes_nothing(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    send(qtbot, win, "Name a color.")
    first = store.messages(win.conversation_id)[-1]
    # the second version is stopped after three tokens: a different text to tell them apart
    bridge.engine.pace.hold()
    bridge.engine.pace.give(3)
    regenerate = qml_items(win, "regenerate")[0]
    hover(qtbot, win, regenerate)
    qml_click(qtbot, win, regenerate)
    qtbot.waitUntil(lambda: len(win.replies.shown.ids) == 3, timeout=10000)
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    bridge.engine.pace.free()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    reply = store.messages(win.conversation_id)[-1]
    assert reply.id == first.id and reply.versions == 2 and reply.version == 1 and reply.interrupted
    assert reply.content != first.content and first.content.startswith(reply.content)
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "versionLabel")] == ["2/2"])
    asked = submits(bridge)
    qml_click(qtbot, win, qml_items(win, "previousVersion")[0])
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "versionLabel")] == ["1/2"])
    assert first.content in win.chat_view.toPlainText()
    shown = store.messages(win.conversation_id)[-1]
    assert (shown.content, shown.token_ids, shown.interrupted) == (first.content, first.token_ids, False)
    qml_click(qtbot, win, qml_items(win, "nextVersion")[0])
    qtbot.waitUntil(lambda: [i.property("text") for i in qml_items(win, "versionLabel")] == ["2/2"])
    assert store.messages(win.conversation_id)[-1].content == reply.content
    bridge.engine.flush().result(30)
    assert submits(bridge) == asked  # switching versions asked the engine for nothing
    qml_click(qtbot, win, qml_items(win, "previousVersion")[0])
    send(qtbot, win, "And another?")  # the next turn follows the version shown
    sent = [c for c in bridge.engine.commands_seen if isinstance(c, Submit)][-1].handle.request.messages
    assert sent[-2]["content"] == first.content


def test_escape_before_the_first_token_keeps_no_empty_reply(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    bridge.engine.pace.hold()  # the first token never comes
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert bridge.busy
    qtbot.keyClick(win.input, Qt.Key_Escape)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    assert [m.role for m in store.messages(win.conversation_id)] == ["user"]
    assert "interrupted" not in win.chat_view.toPlainText() and not qml_items(win, "author")


def test_a_message_left_unanswered_offers_a_retry_that_answers_it(qtbot, app_parts):
    """Stopped before its first word, the reply is not kept; the message stays, with its actions
    shown and an "Answer this message" button, which answers it (and then goes)."""
    win, store, bridge, _ = app_parts
    assert not qml_items(win, "retry")
    bridge.engine.pace.hold()
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert bridge.busy and not qml_items(win, "retry")  # answering: nothing to retry
    qtbot.keyClick(win.input, Qt.Key_Escape)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    qtbot.waitUntil(lambda: len(qml_items(win, "retry")) == 1, timeout=3000)
    actions = qml_items(win, "actions")
    assert len(actions) == 1 and actions[0].property("opacity") > 0  # shown without pointing at it
    bridge.engine.pace.lockstep()
    qml_click(qtbot, win, qml_items(win, "retry")[0])
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and len(store.messages(win.conversation_id)) == 2,
                    timeout=60000)
    assert [m.role for m in store.messages(win.conversation_id)] == ["user", "assistant"]
    assert store.messages(win.conversation_id)[-1].content and not qml_items(win, "retry")


def test_quit_during_the_warm_up_keeps_no_empty_reply(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    compiled = bridge.engine.warm_up()  # the reply waits for a compile that does not end before quit
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert bridge.busy and win.replies.shown is not None
    win.close()
    win.replies.save_so_far()  # what main.run does once app.exec() returns
    assert [m.role for m in store.messages(win.conversation_id)] == ["user"]
    compiled.set()


def test_a_regenerate_stopped_before_its_first_token_leaves_the_reply_as_it_was(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    send(qtbot, win, "Name a color.")
    before = store.messages(win.conversation_id)[-1]
    bridge.engine.pace.hold()
    qml_click(qtbot, win, qml_items(win, "regenerate")[0])
    assert bridge.busy
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    after = store.messages(win.conversation_id)[-1]
    assert (after.id, after.content, after.versions, after.interrupted) == (before.id, before.content, 1, False)


def test_enter_right_after_stop_sends_once_the_reply_has_stopped(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    bridge.engine.pace.hold()
    bridge.engine.pace.give(2)
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(win.replies.shown.ids) == 2, timeout=10000)
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    assert bridge.busy  # the engine's cancelled end has not arrived yet
    win.input.setPlainText("Name a color.")
    bridge.engine.pace.free()
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert win.notice_label.text() == SEND_AFTER_STOP
    qtbot.waitUntil(lambda: len(store.messages(win.conversation_id)) == 4, timeout=10000)
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    messages = store.messages(win.conversation_id)
    assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
    assert messages[1].interrupted and messages[2].content == "Name a color." and not messages[3].interrupted
    assert not win.input.toPlainText()


def test_enter_while_a_reply_streams_says_why_it_did_not_send(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    bridge.engine.pace.hold()
    win.input.setPlainText("Hello")
    qtbot.keyClick(win.input, Qt.Key_Return)
    win.input.setPlainText("Next question")
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert "stop it first" in win.notice_label.text() and win.input.toPlainText() == "Next question"
    bridge.engine.pace.free()
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)


def loads(bridge):
    bridge.engine.flush().result(30)
    return sum(isinstance(c, LoadModel) for c in bridge.engine.commands_seen)


def test_a_weights_change_during_a_reply_asks_before_stopping_it(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    before = loads(bridge)
    bridge.engine.pace.hold()
    bridge.engine.pace.give(2)
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    qtbot.waitUntil(lambda: len(win.replies.shown.ids) == 2, timeout=10000)

    def int4_weights(dialog):
        dialog.weights.setCurrentText("int4")
        dialog.save_button.click()

    with answering(Question, no) as asked, answering(SettingsDialog, int4_weights):
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert "A reply is being written" in asked[0] and "int4" in asked[0]
    # no switch asked of the engine (it sets loading at once); the reply streams on
    assert bridge.busy and not bridge.loading and "reply goes on" in win.notice_label.text()
    bridge.engine.pace.give(2)
    qtbot.waitUntil(lambda: len(win.replies.shown.ids) == 4, timeout=10000)  # it went on
    with answering(Question, yes) as asked, answering(SettingsDialog, int4_weights):
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert asked
    qtbot.waitUntil(lambda: not bridge.loading and win.send_button.isEnabled(), timeout=10000)
    assert loads(bridge) == before + 1 and store.setting("engine")["weights"] == "int4"
    reply = store.messages(win.conversation_id)[-1]
    assert reply.role == "assistant" and reply.interrupted and len(reply.content.split()) >= 4


def test_a_message_waiting_for_a_stop_is_not_sent_once_another_chat_is_open(qtbot, app_parts):
    """Enter during a stop sends once the reply has ended, into its own chat; open another chat
    before that and the message stays in the box, unsent, for the user to place."""
    win, store, bridge, _ = app_parts
    other = store.create_conversation("Older chat")
    win.chats.refresh()
    bridge.engine.pace.hold()
    bridge.engine.pace.give(2)
    win.input.setPlainText("Write a very long story.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    first = win.conversation_id
    qtbot.waitUntil(lambda: len(win.replies.shown.ids) == 2, timeout=10000)
    qtbot.mouseClick(win.stop_button, Qt.LeftButton)
    win.input.setPlainText("Name a color.")
    qtbot.keyClick(win.input, Qt.Key_Return)
    assert win.notice_label.text() == SEND_AFTER_STOP
    click_chat(qtbot, win, "Older chat")
    assert win.conversation_id == other and win.notice_label.text() != SEND_AFTER_STOP
    qtbot.waitUntil(lambda: not bridge.busy, timeout=10000)
    assert [m.role for m in store.messages(first)] == ["user", "assistant"] and not store.messages(other)
    assert win.input.toPlainText() == "Name a color."


def test_escape_stops_a_reply_right_after_two_dialogs_closed(qtbot, app_parts):
    """Issue 49 point 9: after two modal dialogs closed, no window was active (no window manager
    gives the focus back under Xvfb, nor under some desktops), so Escape reached nothing until a
    click. A dialog now hands the keyboard back to the window it came from."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    win.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is win)
    held_reply(qtbot, win, bridge)
    with answering(SettingsDialog, lambda d: d.reject()) as closed:
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    with answering(PersonaDialog, lambda d: d.reject()) as closed_too:
        qtbot.mouseClick(win.persona_edit_button, Qt.LeftButton)
    assert closed and closed_too
    qtbot.waitUntil(lambda: QApplication.activeWindow() is win, timeout=3000)
    qtbot.keyClick(QApplication.focusWidget() or win, Qt.Key_Escape)  # where the keyboard is now
    qtbot.waitUntil(lambda: win.send_button.isEnabled(), timeout=10000)
    assert not bridge.busy
