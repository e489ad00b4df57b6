"""The desktop program's conventions, through keys and clicks on the window (the fake backend):
focus keys, shortcuts, a chat's context menu, the window and last chat restored, export's default
file, and a message box that grows."""
from PySide6.QtCore import QStandardPaths, Qt
from PySide6.QtGui import QContextMenuEvent
from PySide6.QtWidgets import QApplication, QFileDialog, QLineEdit, QMenu, QStyle, QStyleOptionSlider

from kvchat.app.views.composer_height import MAX_LINES
from kvchat.app.views.settings_dialog import SettingsDialog
from kvchat.app.views.sheet import Question, TextAsk

from conftest import fake_engine, window
from qt_helpers import answering, send, typed, yes


def focused(win):
    return QApplication.focusWidget()


def activate(qtbot, win):
    win.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is win)
    win.input.setFocus()
    qtbot.waitUntil(lambda: win.input.hasFocus())


def test_tab_moves_to_send_and_back_and_the_keyboard_sends(qtbot, app_parts):
    win, store, _, _ = app_parts
    activate(qtbot, win)
    qtbot.keyClicks(win.input, "Name a color.")
    qtbot.keyClick(win.input, Qt.Key_Tab)
    assert "\t" not in win.input.toPlainText() and focused(win) is win.send_button
    qtbot.keyClick(win.send_button, Qt.Key_Backtab, Qt.ShiftModifier)
    assert focused(win) is win.input
    qtbot.keyClick(win.input, Qt.Key_Tab)
    qtbot.keyClick(win.send_button, Qt.Key_Space)  # Send, pressed from the keyboard
    qtbot.waitUntil(lambda: win.send_button.isEnabled() and len(store.messages(win.conversation_id)) == 2,
                    timeout=10000)
    win.input.setFocus()
    qtbot.keyClicks(win.input, "And another?")
    qtbot.keyClick(win.input, Qt.Key_Return, Qt.ControlModifier)  # Ctrl+Enter sends too
    qtbot.waitUntil(lambda: len(store.messages(win.conversation_id)) == 4, timeout=10000)


def test_ctrl_f_searches_ctrl_comma_opens_settings_ctrl_q_quits(qtbot, app_parts):
    win, store, _, _ = app_parts
    activate(qtbot, win)
    send(qtbot, win, "Name a color.")
    activate(qtbot, win)
    qtbot.keyClick(win.input, Qt.Key_F, Qt.ControlModifier)
    assert focused(win) is win.search and not win.input.toPlainText()
    qtbot.keyClicks(win.search, "zzz")
    assert win.conversation_list.chat_items() == []
    win.search.clear()
    with answering(SettingsDialog, lambda dialog: dialog.reject()) as opened:
        qtbot.keyClick(win.search, Qt.Key_Comma, Qt.ControlModifier)
    assert len(opened) == 1
    activate(qtbot, win)
    qtbot.keyClick(win.input, Qt.Key_Q, Qt.ControlModifier)
    assert not win.isVisible()


def menu_action(qtbot, menu: QMenu, text: str):
    qtbot.waitUntil(menu.isVisible)
    action = next(a for a in menu.actions() if a.text() == text)
    qtbot.mouseClick(menu, Qt.LeftButton, pos=menu.actionGeometry(action).center())


def right_click_chat(qtbot, win, title):
    chats = win.conversation_list
    item = next(i for i in chats.chat_items() if i.text() == title)
    pos = chats.visualItemRect(item).center()
    # the event a right click becomes on a desktop (QTest's clicks offscreen do not make one)
    QApplication.sendEvent(chats.viewport(), QContextMenuEvent(QContextMenuEvent.Mouse, pos,
                                                               chats.viewport().mapToGlobal(pos)))
    qtbot.waitUntil(lambda: win.desktop.menu is not None and win.desktop.menu.isVisible())
    return win.desktop.menu


def test_a_chats_context_menu_renames_exports_and_deletes_the_chat_it_was_opened_on(qtbot, app_parts, monkeypatch):
    win, store, _, tmp_path = app_parts
    monkeypatch.setenv("HOME", str(tmp_path))  # a home with a Documents folder, this test's own
    monkeypatch.delenv("XDG_DOCUMENTS_DIR", raising=False)
    (tmp_path / "Documents").mkdir()
    send(qtbot, win, "Name a color.")
    first = win.conversation_id
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    send(qtbot, win, "Name a fruit.")

    with answering(TextAsk, typed("Colours")) as renamed:
        menu_action(qtbot, right_click_chat(qtbot, win, "Name a color."), "Rename…")
    assert renamed and store.conversation(first)["title"] == "Colours" and win.conversation_id == first
    target = tmp_path / "exported.md"

    def export(dialog):
        default = dialog.selectedFiles()[0]
        name = dialog.findChild(QLineEdit, "fileNameEdit")  # typed as a user would, then Enter
        name.setText(str(target))
        qtbot.keyClick(name, Qt.Key_Return)
        return default

    with answering(QFileDialog, export) as defaults:
        menu_action(qtbot, right_click_chat(qtbot, win, "Colours"), "Export…")
    assert QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation) == str(tmp_path / "Documents")
    assert defaults == [str(tmp_path / "Documents" / "Colours.md")]  # named after the chat, in Documents
    assert target.read_text().startswith("# Colours")
    with answering(Question, yes) as asked:
        menu_action(qtbot, right_click_chat(qtbot, win, "Colours"), "Delete…")
    assert "Colours" in asked[0] and first not in {c["id"] for c in store.conversations()}
    assert [i.text() for i in win.conversation_list.chat_items()] == ["Name a fruit."]


def test_the_export_file_name_is_the_chats_title_made_safe():
    from kvchat.app.controllers.conversations import file_name

    assert file_name("Plan: 3 days / Lisbon?", ".md") == "Plan 3 days Lisbon.md"
    assert file_name("...", ".json") == "chat.json"


def test_the_window_comes_back_at_its_size_with_its_last_chat(qtbot, app_parts):
    win, store, bridge, tmp_path = app_parts
    send(qtbot, win, "Name a color.")
    first = win.conversation_id
    qtbot.mouseClick(win.new_button, Qt.LeftButton)
    send(qtbot, win, "Name a fruit.")
    chats = win.conversation_list
    item = next(i for i in chats.chat_items() if i.text() == "Name a color.")
    qtbot.mouseClick(chats.viewport(), Qt.LeftButton, pos=chats.visualItemRect(item).center())
    assert win.conversation_id == first
    win.resize(1040, 660)
    qtbot.waitUntil(lambda: (win.width(), win.height()) == (1040, 660))
    win.close()
    engine = fake_engine({})
    again, _, again_bridge = window(qtbot, tmp_path, engine, fake_engine)  # the same data dir
    try:
        assert (again.width(), again.height()) == (1040, 660)
        assert again.conversation_id == first and again.conversation_list.currentItem().text() == "Name a color."
        assert "Name a color." in again.chat_view.toPlainText()
    finally:
        again_bridge.engine.close()
        engine.close()


def test_a_fresh_data_dir_opens_at_the_default_size_with_no_chat(qtbot, app_parts):
    win, _, _, _ = app_parts
    assert (win.width(), win.height()) == (1200, 720) and win.conversation_id is None


def test_the_message_box_grows_to_ten_lines_then_scrolls(qtbot, app_parts):
    win, _, _, _ = app_parts
    box, height = win.input, win.input_height
    empty = box.height()
    qtbot.keyClicks(box, "line 1")
    assert box.height() == empty  # two lines' room from the start
    for n in range(2, 6):
        qtbot.keyClick(box, Qt.Key_Return, Qt.ShiftModifier)
        qtbot.keyClicks(box, f"line {n}")
    assert box.height() == height.height_for(5) > empty and box.verticalScrollBar().maximum() == 0
    for n in range(6, 16):
        qtbot.keyClick(box, Qt.Key_Return, Qt.ShiftModifier)
        qtbot.keyClicks(box, f"line {n}")
    assert box.height() == height.height_for(MAX_LINES) and box.verticalScrollBar().maximum() > 0
    bar = box.verticalScrollBar()  # a thin bar in the theme's colours, with no old-style arrows
    option = QStyleOptionSlider()
    bar.initStyleOption(option)
    for arrow in (QStyle.SC_ScrollBarAddLine, QStyle.SC_ScrollBarSubLine):
        assert bar.style().subControlRect(QStyle.CC_ScrollBar, option, arrow, bar).height() == 0
    assert bar.isVisible() and bar.width() <= 12
    qtbot.keyClick(box, Qt.Key_Return)  # sent: back to its first size
    qtbot.waitUntil(lambda: box.height() == empty, timeout=10000)
