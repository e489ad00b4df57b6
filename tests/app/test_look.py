"""One visual language in plain words (issue 29): Settings speaks plain words with help lines and
the expert term in tooltips, and is drawn in the theme's colours; code blocks wrap at words and guess
an untagged block's language; a search with no match says so; a shrinking window keeps the latest
reply in view; in dark mode, hovering "New chat" shows."""
from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QApplication, QFrame, QLabel

from kvchat.app.views.connection_box import MANAGE
from kvchat.app.views.persona_dialog import PersonaDialog
from kvchat.app.views.settings_dialog import SettingsDialog
from kvchat.app.views.sheet import Question, TextAsk
from kvchat.app.views.theme import COLOURS

from qt_helpers import answering, qml_items, send, shown
from test_desktop import menu_action, right_click_chat


def to_dark(qtbot, win):
    to_mode(qtbot, win, "dark")


def to_mode(qtbot, win, mode: str):
    while win.theme.mode != mode:  # system, light, dark: the button cycles
        qtbot.mouseClick(win.theme_button, Qt.LeftButton)


def test_settings_speak_plain_words_with_help_and_the_themes_colours(qtbot, app_parts):
    win, _, _, _ = app_parts
    shown(qtbot, win)
    to_dark(qtbot, win)
    seen = {}

    def look(dialog):
        seen["precision"] = [dialog.precision.itemText(i) for i in range(dialog.precision.count())]
        seen["tip"] = dialog.precision.itemData(2, Qt.ToolTipRole)
        seen["weights"] = [dialog.weights.itemText(i) for i in range(dialog.weights.count())]
        seen["help"] = [label.text() for label in dialog.findChildren(QLabel, "help")]
        seen["bg"] = dialog.grab().toImage().pixelColor(4, 4).name()
        dialog.precision.setCurrentIndex(2)  # "moderate (KV int8)"
        dialog.accept()
        return True

    with answering(SettingsDialog, look) as got:
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert got == [True]
    assert seen["precision"] == ["automatic", "off (KV fp16)", "moderate (KV int8)", "moderate, GPU (KV fp8)",
                                 "strong (KV k8v4)", "maximum (KV int4)"]
    assert "8 bits" in seen["tip"] and seen["weights"][1] == "as stored (fp32 on the CPU)"
    assert any("KV cache" in h for h in seen["help"]) and any("headroom" in h for h in seen["help"])
    assert seen["bg"] == COLOURS[True]["bg"]  # drawn in the dark theme, not stock grey
    qtbot.waitUntil(lambda: win.kv_chip.full == "Memory saving: moderate", timeout=10000)  # the value reached the engine


def test_every_dialog_is_drawn_in_the_themes_colours_light_and_dark(qtbot, app_parts):
    """Settings, a chat's rename, the delete confirmation and the connections list, each opened
    through its own control, take the theme's background (not stock grey) in both themes."""
    win, _, _, _ = app_parts
    shown(qtbot, win)
    send(qtbot, win, "Name a color.")
    background = lambda dialog: dialog.grab().toImage().pixelColor(4, 4).name()

    def seen_in(kind, opened, close):
        with answering(kind, lambda d: (background(d), close(d))[0]) as got:
            opened()
        return got

    for mode in ("light", "dark"):
        to_mode(qtbot, win, mode)
        want = [COLOURS[mode == "dark"]["bg"]]
        assert seen_in(SettingsDialog, lambda: qtbot.mouseClick(win.settings_button, Qt.LeftButton),
                       lambda d: d.reject()) == want, mode
        assert seen_in(TextAsk, lambda: menu_action(qtbot, right_click_chat(qtbot, win, "Name a color."),
                                                    "Rename…"), lambda d: d.reject()) == want, mode
        assert seen_in(Question, lambda: menu_action(qtbot, right_click_chat(qtbot, win, "Name a color."),
                                                     "Delete…"), lambda d: d.cancel.click()) == want
        box = win.connection_box
        box.activated.emit(box.findText(MANAGE))  # the list's last entry, as a click on it picks it
        qtbot.waitUntil(lambda: box.dialog is not None and box.dialog.isVisible())
        assert background(box.dialog) == want[0], mode
        box.dialog.reject()
    assert [i.text() for i in win.conversation_list.chat_items()] == ["Name a color."]  # nothing was deleted


def test_every_dialog_speaks_the_librarys_language(qtbot, app_parts):
    """Issue 49 point 8: settings, personas, connections, a rename and a delete were stock Qt
    boxes. Each now opens, through its own control, with a heading that names it, its content in
    a card, and its acting button in the theme's accent, or red where it deletes (light and dark)."""
    win, _, _, _ = app_parts
    shown(qtbot, win)
    send(qtbot, win, "Name a color.")
    paint = lambda button: button.grab().toImage().pixelColor(button.width() // 2, 3).name()

    def look(dialog):
        acting = [b for b in dialog.buttons.buttons() if b.property("kind") in ("accent", "danger")]
        colours = COLOURS[win.theme.dark]
        seen = (dialog.heading.text(), [colours[b.property("kind")] == paint(b) for b in acting],
                bool(dialog.findChildren(QFrame, "sheetCard")) or isinstance(dialog, (Question, TextAsk)))  # one line
        dialog.reject()
        return seen

    for mode in ("light", "dark"):
        to_mode(qtbot, win, mode)
        for kind, opened, heading in (
                (SettingsDialog, lambda: qtbot.mouseClick(win.settings_button, Qt.LeftButton), "Settings"),
                (PersonaDialog, lambda: qtbot.mouseClick(win.persona_edit_button, Qt.LeftButton), "Edit persona"),
                (TextAsk, lambda: menu_action(qtbot, right_click_chat(qtbot, win, "Name a color."), "Rename…"),
                 "Rename chat"),
                (Question, lambda: menu_action(qtbot, right_click_chat(qtbot, win, "Name a color."), "Delete…"),
                 "Delete chat")):
            with answering(kind, look) as got:
                opened()
            assert got and got[0][0] == heading and got[0][1] == [True] and got[0][2], (mode, kind, got)


def test_settings_show_every_help_line_whole(qtbot, app_parts):
    """On a short screen the form squeezed its wrapped lines and cut their first and last lines:
    each is now as tall as its text needs."""
    win, _, _, _ = app_parts
    shown(qtbot, win)

    def cut(dialog):
        labels = dialog.findChildren(QLabel, "help") + [dialog.estimate]
        return [label.text()[:30] for label in labels if label.height() < label.heightForWidth(label.width())]

    with answering(SettingsDialog, lambda d: (cut(d), d.reject())[0]) as got:
        qtbot.mouseClick(win.settings_button, Qt.LeftButton)
    assert got == [[]]


def test_code_blocks_wrap_at_words_and_guess_an_untagged_language(qtbot, app_parts):
    win, store, _, _ = app_parts
    shown(qtbot, win)
    win.chats.new()
    store.add_message(win.conversation_id, "user", "Code please")
    long_line = "print(" + " ".join(f"'word{i}'" for i in range(60)) + ")"
    store.add_message(win.conversation_id, "assistant", f"Here:\n\n```\nimport os\n{long_line}\n```\n")
    win.render_chat()
    qtbot.waitUntil(lambda: len(qml_items(win, "codeBlock")) == 1, timeout=5000)
    assert [i.property("text") for i in qml_items(win, "codeLanguage")] == ["python"]  # not "text"
    code = qml_items(win, "codeText")[0]
    assert code.property("lineCount") > 2  # the long line wraps
    plain = code.property("plain")
    height = code.property("height") / code.property("lineCount")
    for line in range(1, code.property("lineCount")):
        at = code.positionAt(1, int(height * line + height / 2))  # where a wrapped line starts
        assert at == 0 or plain[at - 1] in " \n(", (line, plain[max(0, at - 8):at + 8])  # after a space: not mid-word


def test_a_search_with_no_match_says_so(qtbot, app_parts):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    win.chats.new()
    store.add_message(win.conversation_id, "user", "About Lisbon")
    win.chats.refresh()
    qtbot.keyClicks(win.search, "zanzibar")
    assert not win.conversation_list.chat_items()
    assert win.no_match.isVisible() and win.no_match.text().startswith("No chat matches “zanzibar”")
    win.search.clear()
    assert win.conversation_list.chat_items() and win.no_match.isHidden()


def test_a_shrinking_window_keeps_the_latest_reply_in_view(qtbot, app_parts):
    win, store, _, _ = app_parts
    shown(qtbot, win)
    win.resize(1400, 1000)
    win.chats.new()
    for i in range(12):
        store.add_message(win.conversation_id, "user", f"Question {i}")
        store.add_message(win.conversation_id, "assistant", f"Answer {i}\n\nwith a second paragraph")
    win.render_chat()
    view = win.chat_view.list_view()
    qtbot.waitUntil(lambda: view.property("atYEnd"), timeout=5000)
    win.resize(1400, 600)
    qtbot.waitUntil(lambda: win.chat_view.height() < 500, timeout=5000)
    qtbot.waitUntil(lambda: view.property("atYEnd"), timeout=5000)  # the last reply still in view
    assert not qml_items(win, "jumpToLatest")


def test_new_chat_shows_its_hover_in_dark_mode(qtbot, app_parts):
    win, _, _, _ = app_parts
    shown(qtbot, win)
    to_dark(qtbot, win)
    button = win.new_button
    before = button.grab().toImage()
    qtbot.mouseMove(button, QPoint(button.width() // 2, button.height() // 2))
    qtbot.waitUntil(lambda: button.underMouse(), timeout=5000)
    QApplication.processEvents()
    after = button.grab().toImage()
    edge = QPoint(button.width() // 2, 0)  # the border's top edge
    assert after.pixelColor(edge).name() != before.pixelColor(edge).name()
    accent = QColor(COLOURS[True]["accent"])
    got = after.pixelColor(edge)
    assert abs(got.red() - accent.red()) + abs(got.green() - accent.green()) + abs(got.blue() - accent.blue()) < 90


def test_the_memory_gauge_and_its_keys_take_the_themes_shade(qtbot, app_parts):
    """Issue 29: the free part of the bar, most of it on a big machine, was a pale green block on
    the dark panel."""
    from kvchat.app.views.gauge import DARK, SEGMENTS

    win, _, _, _ = app_parts
    shown(qtbot, win)
    if not win.memory_button.isChecked():
        qtbot.mouseClick(win.memory_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: win.gauge.updates >= 1 and win.gauge.isVisible(), timeout=10000)
    free_light = dict((label, colour) for _, label, colour in SEGMENTS)["free"]

    def free_pixel():
        image = win.gauge.grab().toImage()
        return image.pixelColor(image.width() - 4, image.height() // 2).name()  # the bar ends with "free"

    assert free_pixel() == free_light and free_light in win.memory_panel.keys["free"].text()
    to_dark(qtbot, win)
    qtbot.waitUntil(lambda: free_pixel() == DARK["free"], timeout=5000)
    assert DARK["free"] in win.memory_panel.keys["free"].text()
    assert QColor(DARK["free"]).lightnessF() < 0.3 < QColor(free_light).lightnessF()
