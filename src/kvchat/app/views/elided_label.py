"""A one-line label that ends in "…" where its room is short, instead of being cut mid-word under
the widget beside it; ``text()`` stays the whole line (the tooltip shows it)."""
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import QPainter
from PySide6.QtWidgets import QLabel


class ElidedLabel(QLabel):
    MIN_WIDTH = 60  # a layout short of room may shrink it to this, not only to its whole text

    def minimumSizeHint(self) -> QSize:
        hint = super().minimumSizeHint()
        return QSize(min(self.MIN_WIDTH, hint.width()), hint.height())

    def shown_text(self) -> str:
        return self.fontMetrics().elidedText(self.text(), Qt.ElideRight, self.contentsRect().width())

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        self.style().drawItemText(painter, self.contentsRect(), int(self.alignment()), self.palette(),
                                  self.isEnabled(), self.shown_text(), self.foregroundRole())
