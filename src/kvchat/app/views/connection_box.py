"""The top bar's "runs on" box: this computer, each saved connection, and "Manage connections…",
which opens the list where connections are added, edited and removed."""
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QComboBox, QStyle, QStyleOptionComboBox, QStylePainter

from kvchat.core.connections import Connections

from kvchat.app.views.connections_dialog import ConnectionsDialog

LOCAL = "This computer"
MANAGE = "Manage connections…"
_MANAGE = object()  # the last item's data: not a connection's name


class ConnectionBox(QComboBox):
    picked = Signal(object)  # a saved connection's name, or None for this computer

    def __init__(self, connections: Connections | None = None):
        super().__init__(objectName="connectionBox")
        self.connections = connections or Connections()
        self.current: str | None = None
        self.dialog: ConnectionsDialog | None = None
        self.setToolTip("Where replies are computed: this computer, or a server you connected to")
        # a steady width: sized to its longest entry it took the chips' room, then got squeezed once they filled
        self.setSizeAdjustPolicy(QComboBox.AdjustToMinimumContentsLengthWithIcon)
        self.setMinimumContentsLength(10)
        self.activated.connect(self._on_activated)  # the user's choices only, not fill()'s
        self.fill()

    def paintEvent(self, event) -> None:
        """The chosen entry elided ("This comp…") in a narrow bar: a plain combo box cut it
        mid-letter at its minimum width."""
        painter = QStylePainter(self)
        option = QStyleOptionComboBox()
        self.initStyleOption(option)
        painter.drawComplexControl(QStyle.CC_ComboBox, option)
        field = self.style().subControlRect(QStyle.CC_ComboBox, option, QStyle.SC_ComboBoxEditField, self)
        option.currentText = self.fontMetrics().elidedText(option.currentText, Qt.ElideRight, field.width())
        painter.drawControl(QStyle.CE_ComboBoxLabel, option)

    def fill(self, current: str | None = ...) -> None:
        if current is not ...:
            self.current = current
        self.blockSignals(True)
        self.clear()
        self.addItem(LOCAL, None)
        for c in self.connections.all():
            self.addItem(c.name, c.name)
            self.setItemData(self.count() - 1, f"{c.base_url} · {c.model or 'its first model'}", 3)  # ToolTipRole
        self.insertSeparator(self.count())
        self.addItem(MANAGE, _MANAGE)
        self.setCurrentIndex(max(0, self.findData(self.current)))
        self.blockSignals(False)

    def _on_activated(self, index: int) -> None:
        data = self.itemData(index)
        if data is _MANAGE:
            self.setCurrentIndex(max(0, self.findData(self.current)))
            self.manage()
        elif data != self.current or data is not None:  # the same connection again: a retry
            self.picked.emit(data)

    def manage(self) -> ConnectionsDialog:
        """The list of connections, opened without blocking the event loop (a reply keeps streaming)."""
        self.dialog = ConnectionsDialog(self.window(), self.connections, self.current)
        self.dialog.chosen.connect(self._on_chosen)
        self.dialog.finished.connect(lambda _: self.fill())  # added or removed ones show at once
        self.dialog.open()
        return self.dialog

    def _on_chosen(self, name) -> None:
        if name != self.current or name is not None:
            self.picked.emit(name)
