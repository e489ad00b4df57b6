"""The message box's height follows what is typed: from two lines up to about ten, then it scrolls
(a fixed three lines hid most of a long message behind scroll arrows)."""
import math

from PySide6.QtCore import QEvent, QObject

MIN_LINES, MAX_LINES = 2, 10


class ComposerHeight(QObject):
    def __init__(self, edit):
        super().__init__(edit)
        self.edit = edit
        edit.document().documentLayout().documentSizeChanged.connect(self.fit)
        if hasattr(edit, "attachments_changed"):  # the attachment tray takes room above the text
            edit.attachments_changed.connect(self.fit)
        edit.installEventFilter(self)
        self.fit()

    def eventFilter(self, obj, event) -> bool:
        if event.type() in (QEvent.FontChange, QEvent.StyleChange, QEvent.Polish):  # the line height changed
            self.fit()
        return False

    def lines(self) -> int:
        """Lines as shown, wrapped ones counted: a plain-text layout measures its height in lines."""
        return max(1, int(self.edit.document().documentLayout().documentSize().height()))

    def line_height(self) -> float:
        """A laid-out line's height: a pixel more than the font's line spacing here, which showed a
        scroll bar one line early."""
        layout = self.edit.document().firstBlock().layout()
        if layout is not None and layout.lineCount():
            return layout.lineAt(0).height()
        return self.edit.fontMetrics().height() + 1

    def height_for(self, lines: int) -> int:
        edit = self.edit
        return math.ceil(lines * self.line_height() + 2 * edit.document().documentMargin()
                         + 2 * edit.frameWidth() + edit.viewportMargins().top() + edit.viewportMargins().bottom()) + 1

    def fit(self, *_) -> None:
        height = self.height_for(min(MAX_LINES, max(MIN_LINES, self.lines())))
        if height != self.edit.height():
            self.edit.setFixedHeight(height)
