"""kvchat's dialogs in the model library's language: a heading and a muted line under it, the
content in rounded cards, the buttons at the foot, the one that acts in the accent colour (or in
red where it deletes). ``confirm`` and ``ask_text`` replace the stock question and input boxes.

A dialog gives the keyboard back to the window it came from when it closes: without a window
manager (and under some) no window was active after a modal dialog, and Escape did not stop a
reply until the user clicked the window."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import (QDialog, QDialogButtonBox, QFrame, QLabel, QLineEdit, QPushButton, QVBoxLayout,
                               QWidget)


class Sheet(QDialog):
    def __init__(self, parent: QWidget | None, title: str, subtitle: str = ""):
        super().__init__(parent)
        self.setWindowTitle(title)
        self.outer = QVBoxLayout(self)
        self.outer.setContentsMargins(20, 18, 20, 16)
        self.outer.setSpacing(10)
        self.heading = QLabel(title, objectName="sheetTitle")
        self.outer.addWidget(self.heading)
        self.subtitle = QLabel(subtitle, objectName="sheetSubtitle", wordWrap=True)
        self.subtitle.setVisible(bool(subtitle))
        self.outer.addWidget(self.subtitle)
        self.content = QVBoxLayout()
        self.content.setSpacing(10)
        self.outer.addLayout(self.content, 1)
        self.buttons = QDialogButtonBox(objectName="sheetButtons")
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        self.outer.addWidget(self.buttons)

    def card(self, layout_class=QVBoxLayout):
        """A rounded card in the body, as the library's model cards; returns its layout."""
        frame = QFrame(objectName="sheetCard")
        layout = layout_class(frame)
        layout.setContentsMargins(14, 12, 14, 12)
        self.content.addWidget(frame)
        return layout

    def button(self, text: str, role=QDialogButtonBox.AcceptRole, kind: str = "") -> QPushButton:
        """A foot button; ``kind`` "accent" (what the dialog is for) or "danger" (it deletes)."""
        button = self.buttons.addButton(text, role)
        if kind:
            mark(button, kind)
        return button

    def done(self, result: int) -> None:
        """Closed, by exec() or open(): the window it came from takes the keyboard again."""
        parent = self.parentWidget()
        super().done(result)
        give_keys_back(parent)


def mark(button: QPushButton, kind: str) -> None:
    """The style sheet's colour for a button of this kind. The button box polished its buttons as it
    laid them out, so a property set after that is read only once the button is polished again."""
    button.setProperty("kind", kind)
    button.style().unpolish(button)
    button.style().polish(button)


def give_keys_back(parent: QWidget | None) -> None:
    """The window the dialog came from takes the keyboard again (Escape, Ctrl+N...)."""
    window = parent.window() if parent is not None else None
    if window is not None and window.isVisible():
        window.activateWindow()


class Question(Sheet):
    """A yes-or-cancel question whose yes stops, deletes or removes something: its button says what
    (``action``), in red; Cancel is the default, so Enter does nothing for good."""

    def __init__(self, parent: QWidget | None, title: str, question: str, action: str):
        super().__init__(parent, title)
        self.text = QLabel(question, objectName="sheetText", wordWrap=True)
        self.text.setMinimumWidth(360)
        self.content.addWidget(self.text)
        self.cancel = self.button("Cancel", QDialogButtonBox.RejectRole, "plain")
        self.action = self.button(action, QDialogButtonBox.AcceptRole, "danger")
        self.cancel.setDefault(True)


def confirm(parent: QWidget | None, title: str, question: str, action: str) -> bool:
    return Question(parent, title, question, action).exec() == QDialog.Accepted


class TextAsk(Sheet):
    """One line to type (hidden as typed where ``secret``)."""

    def __init__(self, parent: QWidget | None, title: str, prompt: str, text: str = "", secret: bool = False,
                 action: str = "OK"):
        super().__init__(parent, title, prompt)
        self.field = QLineEdit(text, objectName="sheetField")
        if secret:
            self.field.setEchoMode(QLineEdit.Password)
        self.field.setMinimumWidth(360)
        self.field.selectAll()
        self.content.addWidget(self.field)
        self.button("Cancel", QDialogButtonBox.RejectRole, "plain")
        self.action = self.button(action, QDialogButtonBox.AcceptRole, "accent")
        self.action.setDefault(True)


def ask_text(parent: QWidget | None, title: str, prompt: str, text: str = "", secret: bool = False,
             action: str = "OK") -> str | None:
    """What was typed, stripped; None where cancelled or left empty."""
    sheet = TextAsk(parent, title, prompt, text, secret, action)
    if sheet.exec() != QDialog.Accepted:
        return None
    return sheet.field.text().strip() or None


def tell_later(parent: QWidget | None, title: str, message: str) -> Sheet:
    """A message shown without blocking the event loop (replies go on streaming behind it)."""
    sheet = Sheet(parent, title)
    sheet.setObjectName("tell")
    sheet.setAttribute(Qt.WA_DeleteOnClose)
    text = QLabel(message, objectName="sheetText", wordWrap=True)
    text.setMinimumWidth(360)
    sheet.content.addWidget(text)
    sheet.button("OK", QDialogButtonBox.AcceptRole, "accent").setDefault(True)
    sheet.open()
    return sheet
