"""The chat view: the QML ListView (qml/ChatView.qml) in a widget, over a ChatModel. The QML calls
back through ``ChatActions``; the window connects to its signals."""
import os

from PySide6.QtCore import Property, QObject, QUrl, Qt, Signal, Slot
from PySide6.QtGui import QGuiApplication
from PySide6.QtQuick import QQuickWindow, QSGRendererInterface
from PySide6.QtQuickControls2 import QQuickStyle
from PySide6.QtQuickWidgets import QQuickWidget

from kvchat.app.models.chat_model import ChatModel
from kvchat.app.package_data import ASSETS, QML_DIR
from kvchat.app.views.icons import ICONS

QML = QML_DIR / "ChatView.qml"


class ChatActions(QObject):
    """What the QML asks of the window."""
    copied = Signal(str)
    edit_requested = Signal(int)  # the user message's position
    regenerate_requested = Signal()
    version_requested = Signal(int, int)  # the reply's position, the version to show
    prompt_chosen = Signal(str)
    where_changed = Signal()
    LOCAL_NOTE = "Everything runs on this computer: nothing you type leaves it."

    def __init__(self):
        super().__init__()
        self._where = self.LOCAL_NOTE

    def set_where(self, note: str) -> None:
        """The empty chat's line on where replies are computed (a connection sends the text away)."""
        if note != self._where:
            self._where = note
            self.where_changed.emit()

    where = Property(str, lambda self: self._where, notify=where_changed)

    @Slot(str)
    def copyText(self, text: str) -> None:
        QGuiApplication.clipboard().setText(text)
        self.copied.emit(text)

    @Slot(int)
    def edit(self, position: int) -> None:
        self.edit_requested.emit(position)

    @Slot()
    def regenerate(self) -> None:
        self.regenerate_requested.emit()

    @Slot(int, int)
    def showVersion(self, position: int, idx: int) -> None:
        self.version_requested.emit(position, idx)

    @Slot(str)
    def usePrompt(self, text: str) -> None:
        self.prompt_chosen.emit(text)


def prepare_quick() -> None:
    """Before the first Qt Quick window: the software renderer (no GPU driver or GL library needed,
    and a chat view is cheap to raster) unless QT_QUICK_BACKEND says otherwise, and Fusion controls
    to match the widgets."""
    if not os.environ.get("QT_QUICK_BACKEND"):
        QQuickWindow.setGraphicsApi(QSGRendererInterface.GraphicsApi.Software)
    if not QQuickStyle.name():
        QQuickStyle.setStyle("Fusion")


class ChatView(QQuickWidget):
    pressed = Signal()  # a click anywhere in the conversation: the window gives the message box the keys

    def __init__(self, theme, parent=None):
        prepare_quick()
        super().__init__(parent)
        self.model = ChatModel(theme.dark)
        self.actions = ChatActions()
        self.theme = theme
        if theme.parent() is None:  # owned by Qt: QML may still read it while the window is torn down
            theme.setParent(self)
        theme.changed.connect(lambda: self.model.set_dark(theme.dark))
        # a click in the conversation must not take the keyboard from the message box
        self.setFocusPolicy(Qt.NoFocus)
        self.setResizeMode(QQuickWidget.SizeRootObjectToView)
        ctx = self.rootContext()
        for name, value in (("chatModel", self.model), ("chat", self.actions), ("theme", theme),
                            ("iconDir", QUrl.fromLocalFile(str(ICONS)).toString()),
                            ("assetDir", QUrl.fromLocalFile(str(ASSETS)).toString())):
            ctx.setContextProperty(name, value)
        self.setSource(QUrl.fromLocalFile(str(QML)))
        if self.status() == QQuickWidget.Error:
            raise RuntimeError("the chat view's QML failed: " + "; ".join(e.toString() for e in self.errors()))

    def mousePressEvent(self, event) -> None:
        super().mousePressEvent(event)
        self.pressed.emit()

    def item(self, name: str):
        return next((i for i in self.items() if i.objectName() == name), None)

    def items(self):
        """Every QML item, depth first (delegates are items of the view, not QObject children)."""
        stack = [self.rootObject()]
        while stack:
            item = stack.pop()
            yield item
            stack.extend(reversed(item.childItems()))

    def list_view(self):
        return self.item("messages")

    def toPlainText(self) -> str:
        """The text of the messages the view has made, in order: what a reader can see or scroll to."""
        return "\n".join(i.property("plain") for i in self.items()
                         if i.objectName() in ("messageText", "codeText") and i.isVisible())
