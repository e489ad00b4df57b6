"""The live memory gauge: one stacked bar, from the engine's snapshots."""
from PySide6.QtCore import QRectF, Qt
from PySide6.QtGui import QColor, QPainter
from PySide6.QtWidgets import QLabel, QWidget

from kvchat.core.memory import GiB

SEGMENTS = [  # snapshot key, label, colour
    ("other_processes", "other programs", "#9e9e9e"),
    ("weights", "weights", "#5c6bc0"),
    ("kv_in_use", "KV in use", "#ef6c00"),
    ("kv_reclaimable", "prefix cache", "#ffb74d"),
    ("kv_free", "KV free", "#ffe0b2"),
    ("activations_reserve", "activations", "#8d6e63"),
    ("free", "free", "#e8f5e9"),
]


def segments(snapshot: dict) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) in bar order; the pool's unused blocks are their own segment."""
    values = dict(snapshot)
    values["kv_free"] = max(0, snapshot["kv_total"] - snapshot["kv_in_use"] - snapshot["kv_reclaimable"])
    return [(label, int(values[key]), colour) for key, label, colour in SEGMENTS]


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
            painter.fillRect(rect, QColor("#eeeeee"))
            return
        x = rect.left()
        for _, size, colour in segments(self.snapshot):
            width = rect.width() * size / self.snapshot["total"]
            painter.fillRect(QRectF(x, rect.top(), width, rect.height()), QColor(colour))
            x += width


def legend() -> QLabel:
    """Colour keys for the bar, in its order."""
    keys = " ".join(f'<span style="color:{colour}">&#9632;</span> {label}' for _, label, colour in SEGMENTS)
    return QLabel(keys)
