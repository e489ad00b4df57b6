"""The live memory gauge: one stacked bar, from the engine's snapshots."""
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPalette
from PySide6.QtWidgets import QWidget

from kvchat.core.memory import GiB

SEGMENTS = [  # snapshot key, label, colour
    ("other_processes", "other programs", "#9e9e9e"),
    ("runtime", "kvchat itself", "#78909c"),
    ("weights", "weights", "#5c6bc0"),
    ("kv_in_use", "KV in use", "#ef6c00"),
    ("kv_reclaimable", "prefix cache", "#ffb74d"),
    ("kv_free", "KV free", "#ffe0b2"),
    ("activations_reserve", "activations", "#8d6e63"),
    ("free", "free", "#e8f5e9"),
]
DARK = {"kv_free": "#6b5a40", "free": "#2e4a36"}  # the light theme's pale keys glared on the dark panel


def is_dark(widget: QWidget) -> bool:
    return widget.palette().color(QPalette.Window).lightness() < 128


def colours(dark: bool) -> dict[str, str]:
    """Each segment's colour by label, in the theme's shade."""
    return {label: DARK.get(key, colour) if dark else colour for key, label, colour in SEGMENTS}


def segments(snapshot: dict, dark: bool = False) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) in bar order; the pool's unused blocks are their own segment."""
    values = dict(snapshot)
    values["kv_free"] = max(0, snapshot["kv_total"] - snapshot["kv_in_use"] - snapshot["kv_reclaimable"])
    shade = colours(dark)
    return [(label, int(values[key]), shade[label]) for key, label, _ in SEGMENTS]


class MemoryGauge(QWidget):
    def __init__(self):
        super().__init__()
        self.snapshot: dict | None = None
        self.setMinimumHeight(22)
        self.updates = 0

    def update_snapshot(self, snapshot: dict) -> None:
        self.snapshot = snapshot
        self.updates += 1
        parts = [f"{label}: {size / GiB:.2f} GiB" for label, size, _ in segments(snapshot)]
        where = "system RAM (running on the CPU)" if snapshot["on_cpu"] else snapshot["device"]
        self.setToolTip(f"{where}, total {snapshot['total'] / GiB:.1f} GiB\n" + "\n".join(parts))
        self.update()

    def paintEvent(self, _event) -> None:
        painter = QPainter(self)
        rect = QRectF(self.rect()).adjusted(0, 2, -1, -2)
        painter.setPen(Qt.NoPen)
        if not self.snapshot or not self.snapshot["total"]:
            painter.fillRect(rect, self.palette().color(QPalette.AlternateBase))
            return
        x = rect.left()
        for _, size, colour in segments(self.snapshot, is_dark(self)):
            width = rect.width() * size / self.snapshot["total"]
            painter.fillRect(QRectF(x, rect.top(), width, rect.height()), QColor(colour))
            x += width

