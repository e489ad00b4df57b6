"""The bundled SVG icon set (assets/icons), drawn in the theme's text colour for widgets; QML tints
the same files itself (icon.color)."""
import sys
from pathlib import Path

from PySide6.QtCore import QByteArray, QRectF, QUrl, Qt
from PySide6.QtGui import QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

# beside the package in a checkout; under sys._MEIPASS in the packaged app
ASSETS = Path(getattr(sys, "_MEIPASS", Path(__file__).resolve().parent.parent)) / "assets"
ICONS = ASSETS / "icons"


def icon(name: str, colour: str, size: int = 20) -> QIcon:
    svg = (ICONS / f"{name}.svg").read_bytes().replace(b"currentColor", colour.encode())
    renderer = QSvgRenderer(QByteArray(svg))
    out = QIcon()
    for scale in (1, 2):  # crisp on high-DPI screens too
        pixmap = QPixmap(size * scale, size * scale)
        pixmap.fill(Qt.transparent)
        painter = QPainter(pixmap)
        renderer.render(painter, QRectF(0, 0, size * scale, size * scale))
        painter.end()
        pixmap.setDevicePixelRatio(scale)
        out.addPixmap(pixmap)
    return out


def icon_url(name: str) -> QUrl:
    return QUrl.fromLocalFile(str(ICONS / f"{name}.svg"))
