"""The bundled SVG icon set (app/assets/icons), drawn in the theme's text colour for widgets; QML tints
the same files itself (icon.color)."""

from PySide6.QtCore import QByteArray, QRectF, QUrl, Qt
from PySide6.QtGui import QIcon, QPainter, QPixmap
from PySide6.QtSvg import QSvgRenderer

from kvchat.app.package_data import ICONS


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
