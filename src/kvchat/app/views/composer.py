"""The message box: a plain text editor whose long pastes and attached files (dropped, pasted or
picked: models/files.py) become attachments, shown as chips in a row above the text (each with its
name, its size in tokens and a remove button). The controllers
read and set the message as one text (toPlainText, setPlainText, clear), as they did before there
were attachments: the attachments ride along in it, between tags (models/attachments.py), so that
sending, editing and resending carry them without knowing of them."""
from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QToolButton, QWidget

from kvchat.app.models.attachments import LONG_PASTE, chip, decode, encode, name_for
from kvchat.app.models.files import Unreadable, read_text
from kvchat.app.views.elided_label import ElidedLabel
from kvchat.app.views.icons import icon

TRAY_HEIGHT = 34


def local_files(source) -> list[str]:
    """The local files a drop or a paste carries (a file manager's copy), if any."""
    return [url.toLocalFile() for url in source.urls() if url.isLocalFile()] if source.hasUrls() else []


class AttachmentChip(QFrame):
    removed = Signal()

    def __init__(self, name: str, text: str, counted: tuple | None = None):
        super().__init__(objectName="attachmentChip")
        shown = chip(name, text, counted)
        self.setProperty("tooLong", bool(shown["problem"]))  # the theme draws it in its warning colour
        self.label = ElidedLabel(f"{name} · {shown['size']}")  # ends in "…" in a narrow box
        self.label.setToolTip(shown["tip"])
        self.icon = QLabel()  # the app's icon: an emoji showed as an empty box without an emoji font
        self.icon.setPixmap(icon("document", self.palette().color(QPalette.WindowText).name(), 16).pixmap(16, 16))
        self.remove_button = QToolButton(text="✕", toolTip="Remove the attachment", autoRaise=True)
        self.remove_button.clicked.connect(self.removed)
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 2, 2, 2)
        row.setSpacing(4)
        row.addWidget(self.icon)
        row.addWidget(self.label)
        row.addWidget(self.remove_button)


class Composer(QPlainTextEdit):
    attachments_changed = Signal()
    attached = Signal(str)  # a new attachment's text: the bridge counts its tokens (set_count)
    refused = Signal(str)  # why a file could not be attached (not text, too large)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.attachments: list[tuple[str, str]] = []  # (name, text), in the order pasted
        self.counted: dict[str, tuple] = {}  # text -> (tokens, why it cannot fit), as the model counts
        self.tray = QWidget(self, objectName="attachmentTray")
        self.tray_row = QHBoxLayout(self.tray)
        self.tray_row.setContentsMargins(6, 4, 6, 0)
        self.tray_row.addStretch(1)
        self.tray.hide()

    def chips(self) -> list[AttachmentChip]:
        return self.tray.findChildren(AttachmentChip)

    def canInsertFromMimeData(self, source) -> bool:
        return bool(local_files(source)) or super().canInsertFromMimeData(source)

    def insertFromMimeData(self, source) -> None:
        """Every paste (keys, menu, middle click, a drop): files are attached, a long text becomes an
        attachment."""
        files = local_files(source)
        if files:
            self.attach_files(files)
            return
        text = source.text() if source.hasText() else ""
        if len(text) > LONG_PASTE:
            self.attach(text)
            return
        super().insertFromMimeData(source)

    def attach(self, text: str, name: str | None = None) -> None:
        self.attachments.append((name or name_for(text), text))
        self._show_chips()
        if text not in self.counted:
            self.attached.emit(text)

    def attach_files(self, paths) -> None:
        """Each file's text as an attachment named after the file; one that cannot be read is
        refused (``refused`` says why) and the others still come."""
        for path in paths:
            try:
                self.attach(read_text(path), Path(path).name)
            except Unreadable as why:
                self.refused.emit(str(why))

    def set_count(self, text: str, tokens, problem: str) -> None:
        """The model's count of an attachment's tokens (None and ``problem``: it cannot fit)."""
        self.counted[text] = (tokens, problem)
        if any(t == text for _, t in self.attachments):
            self._show_chips()

    def recount(self) -> None:
        """The counts are another tokenizer's or context's now: each attachment is counted again."""
        self.counted = {}
        self._show_chips()
        for _, text in self.attachments:
            self.attached.emit(text)

    def too_long(self) -> str:
        """Why the message cannot be sent as it is (an attachment longer than the context), or ''."""
        too_long = any(self.counted.get(t, (0, ""))[1] for _, t in self.attachments)
        return "Not sent: an attachment is longer than the context. Shorten it, or raise the context length " \
               "in Settings." if too_long else ""

    def remove(self, index: int) -> None:
        del self.attachments[index]
        self._show_chips()

    def typed(self) -> str:
        return super().toPlainText()

    def toPlainText(self) -> str:
        """The message as it is sent and stored: the typed text and the attachments."""
        return encode(super().toPlainText(), self.attachments)

    def setPlainText(self, text: str) -> None:
        """A message put back in the box (an edit): its attachments as chips again."""
        typed, self.attachments = decode(text)
        super().setPlainText(typed)
        self._show_chips()

    def clear(self) -> None:
        super().clear()
        self.attachments = []
        self._show_chips()

    def _show_chips(self) -> None:
        for old in self.chips():
            old.setParent(None)
            old.deleteLater()
        for i, (name, text) in enumerate(self.attachments):
            item = AttachmentChip(name, text, self.counted.get(text))
            item.removed.connect(lambda i=i: self.remove(i))
            self.tray_row.insertWidget(i, item)
        shown = bool(self.attachments)
        self.tray.setVisible(shown)
        self.setViewportMargins(0, TRAY_HEIGHT if shown else 0, 0, 0)
        self._place_tray()
        self.attachments_changed.emit()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._place_tray()

    def _place_tray(self) -> None:
        frame = self.frameWidth()
        self.tray.setGeometry(frame, frame, self.width() - 2 * frame, TRAY_HEIGHT)
