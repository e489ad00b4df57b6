"""What the user sees in the first second: the icon and a line saying what is starting, shown before
the engine's libraries (torch, transformers) are imported, which takes several seconds."""
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QFont, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer
from PySide6.QtWidgets import QSplashScreen

from .icons import ASSETS
from .theme import COLOURS


def splash_pixmap(dark: bool) -> QPixmap:
    colours = COLOURS[dark]
    pixmap = QPixmap(420, 240)
    pixmap.fill(QColor(colours["bg"]))
    painter = QPainter(pixmap)
    painter.setRenderHint(QPainter.Antialiasing)
    QSvgRenderer(str(ASSETS / "kvchat.svg")).render(painter, QRectF(178, 44, 64, 64))
    font = QFont()
    font.setPixelSize(26)
    font.setBold(True)
    painter.setFont(font)
    painter.setPen(QColor(colours["text"]))
    painter.drawText(QRectF(0, 120, 420, 40), Qt.AlignCenter, "kvchat")
    painter.end()
    return pixmap


class Splash(QSplashScreen):
    def __init__(self, dark: bool):
        super().__init__(splash_pixmap(dark))
        self.colour = QColor(COLOURS[dark]["muted"])

    def say(self, message: str) -> None:
        self.showMessage(message, Qt.AlignBottom | Qt.AlignHCenter, self.colour)
