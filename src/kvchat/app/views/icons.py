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


def tinted_file(name: str, colour: str) -> str:
    """The icon in ``colour`` as a file, for a style sheet's ``image: url(...)`` (which reads files,
    not bytes), written once per colour beside kvchat's other cached files."""
    from kvchat.core.paths import cache_dir

    path = cache_dir() / "icons" / f"{name}-{colour.lstrip('#')}.svg"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes((ICONS / f"{name}.svg").read_bytes().replace(b"currentColor", colour.encode()))
    return path.as_posix()


def icon_url(name: str) -> QUrl:
    return QUrl.fromLocalFile(str(ICONS / f"{name}.svg"))
