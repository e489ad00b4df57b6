"""What a desktop program is expected to do, beyond the chat: its keys (Ctrl+F search, Ctrl+Q quit;
Ctrl+, and Ctrl+N are the window's), a context menu on a chat, and the window's size and last open
chat restored. Kept in the chat database, not QSettings: a fresh data dir (a new user, a test) starts
fresh."""
from PySide6.QtCore import QEvent, QObject, QPoint, Qt
from PySide6.QtGui import QGuiApplication, QKeySequence, QShortcut
from PySide6.QtWidgets import QMenu, QWidget


class DesktopController(QObject):
    def __init__(self, win):
        super().__init__(win)
        self.win, self.store = win, win.store
        self.menu: QMenu | None = None  # the last context menu opened, for whoever needs to find it
        QShortcut(QKeySequence.Find, win, self.search)
        QShortcut(QKeySequence("Ctrl+Q"), win, win.close)
        QWidget.setTabOrder(win.input, win.send_button)
        chats = win.conversation_list
        chats.setContextMenuPolicy(Qt.CustomContextMenu)
        chats.customContextMenuRequested.connect(self.chat_menu)
        win.installEventFilter(self)
        self.restore()

    def search(self) -> None:
        self.win.search.setFocus(Qt.ShortcutFocusReason)
        self.win.search.selectAll()

    def chat_menu(self, pos: QPoint) -> QMenu | None:
        """Rename, export or delete the chat under the pointer: it opens first, so the dialogs name
        the chat the user pointed at."""
        win, chats = self.win, self.win.conversation_list
        item = chats.itemAt(pos)
        if item is None or item.data(Qt.UserRole) is None:
            return None
        chats.setCurrentItem(item)  # opens it (on_select), as a left click would
        self.menu = menu = QMenu(chats, objectName="chatMenu")
        menu.addAction("Rename…", win.chats.rename)
        menu.addAction("Export…", win.chats.export_dialog)
        menu.addSeparator()
        menu.addAction("Delete…", win.chats.delete)
        menu.popup(chats.viewport().mapToGlobal(pos))
        return menu

    def restore(self) -> None:
        """Size, place and maximized state as they were; a place on no screen any more (a monitor
        unplugged) is left to the window manager. Not restoreGeometry: it shrinks the window to the
        screen as Qt sees it before the window manager has said anything."""
        win, saved = self.win, self.store.setting("window") or {}
        if saved.get("width") and saved.get("height"):
            win.resize(saved["width"], saved["height"])
        if "x" in saved and QGuiApplication.screenAt(QPoint(saved["x"], saved["y"])) is not None:
            win.move(saved["x"], saved["y"])
        if saved.get("maximized"):
            win.setWindowState(win.windowState() | Qt.WindowMaximized)
        last = self.store.setting("last_chat")
        if last is not None and any(c["id"] == last for c in self.store.conversations()):
            win.chats.open(last)
            win.chats.refresh()

    def save(self) -> None:
        win = self.win
        place = win.normalGeometry() if win.isMaximized() else win.geometry()
        self.store.set_setting("window", {"x": win.x(), "y": win.y(), "width": place.width(),
                                          "height": place.height(), "maximized": win.isMaximized()})
        self.store.set_setting("last_chat", win.conversation_id)

    def eventFilter(self, obj, event) -> bool:
        if obj is self.win and event.type() == QEvent.Close:
            self.save()
        return False
