"""Driving the window as a user would: clicks on chats and QML items, answers to modal dialogs."""
from contextlib import contextmanager

from PySide6.QtCore import QObject, QPointF, Qt, QTimer, Slot
from PySide6.QtWidgets import QApplication


def back_on_the_starter(qtbot, bridge, store):
    # waitSignal may return before the window's own (queued) slot has started the way back
    # generous: in two full-suite runs of five the way back took over 60 s (cause not found; alone
    # these tests take seconds)
    qtbot.waitUntil(lambda: not bridge.switching and bridge.engine.ready.is_set()
                    and bridge.engine.config.model == "starter", timeout=150000)
    assert bridge.engine.load_error is None
    # the window saves the setting in its own queued slot, after the engine is ready
    qtbot.waitUntil(lambda: (store.setting("engine") or {}).get("model") == "starter", timeout=10000)


def held_reply(qtbot, win, bridge, text="Tell me a story."):
    """``text`` sent with Enter, its reply held after its first token (the fake's pace): a reply
    that stays running until the test gives more tokens or frees the pace."""
    pace = bridge.engine.pace
    pace.hold()
    win.input.setPlainText(text)
    pace.give(1)
    with qtbot.waitSignal(bridge.token, timeout=60000):
        qtbot.keyClick(win.input, Qt.Key_Return)
    return pace


def send(qtbot, win, text):
    win.input.setPlainText(text)
    win.replies.send()
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


def yes(question):
    """A ``sheet.Question`` answered with its action (Delete, Remove...): returns what it asked."""
    text = question.text.text()
    question.action.click()
    return text


def no(question):
    """A ``sheet.Question`` cancelled: returns what it asked."""
    text = question.text.text()
    question.cancel.click()
    return text


def typed(text):
    """A ``sheet.TextAsk`` answered with ``text``: returns the prompt and whether it was hidden."""
    def act(sheet):
        asked = (sheet.subtitle.text(), sheet.field.echoMode())
        sheet.field.setText(text)
        sheet.action.click()
        return asked
    return act


def click_chat(qtbot, win, title):
    chats = win.conversation_list
    item = next(i for i in chats.chat_items() if i.text() == title)
    qtbot.mouseClick(chats.viewport(), Qt.LeftButton, pos=chats.visualItemRect(item).center())


def chat_ids(store):
    return {c["id"] for c in store.conversations("")}


def shown(qtbot, win):
    win.show()
    qtbot.waitExposed(win)
    return win


def qml_items(win, name):
    return [i for i in win.chat_view.items() if i.objectName() == name and i.isVisible()]


def qml_point(item, x=None, y=None):
    """An item's centre (or a point in it) in the chat view's coordinates, for QTest's mouse. Its
    rows and positioners are laid out first, as the frame a user clicks on has them: a row that
    changed in place (a reply's end) lays out at the next polish, and a click before it missed."""
    parent = item
    while parent is not None:  # inner first: a Row's size feeds the ListView's layout
        parent.ensurePolished()
        parent = parent.parentItem()
    x = item.width() / 2 if x is None else x
    y = item.height() / 2 if y is None else y
    return item.mapToScene(QPointF(x, y)).toPoint()


def qml_click(qtbot, win, item):
    qtbot.mouseClick(win.chat_view, Qt.LeftButton, pos=qml_point(item))


def hover(qtbot, win, item):
    """Point at an item as a user would; its message's actions then show."""
    qtbot.mouseMove(win.chat_view, qml_point(item, 10, 10))
    qtbot.mouseMove(win.chat_view, qml_point(item))


def last_stats(win):
    return [i.property("tip") for i in win.chat_view.items() if i.objectName() == "stats" and i.isVisible()]


class _Relay(QObject):
    def __init__(self, bridge):
        super().__init__(bridge)
        self.bridge = bridge

    @Slot(int, str, int)
    def give(self, key: int, _text: str, _token_id: int) -> None:
        pace = getattr(self.bridge.engine, "pace", None)  # a fake backend's (tests/support)
        if pace is not None:
            pace.ack(self.bridge.handles.get(key))


def lockstep(bridge) -> None:
    """The fake backend streams a reply's next token once the window has taken the last one: a
    queued call, so it runs after every slot of ``bridge.token``, a Stop clicked in one included."""
    relay = _Relay(bridge)
    bridge.token.connect(relay.give, Qt.QueuedConnection)


def settled(bridge) -> None:
    """Every command the fake backend was given has run and every event it gave is delivered."""
    bridge.engine.flush().result(30)
    for _ in range(3):  # the bridge's slots may queue calls of their own
        QApplication.processEvents()
