"""The memory panel: where memory goes, in numbers (weights, KV in use, prefix cache, free), the KV
precision, and the largest context each precision would hold here, capped at what the model was
trained on."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QVBoxLayout

from kvchat.engine.memory import GiB

from .gauge import SEGMENTS, MemoryGauge, segments

ROWS = ["weights", "KV in use", "prefix cache", "KV free", "activations", "other programs", "free"]


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / (1 << 20):.0f} MiB"


class MemoryPanel(QFrame):
    def __init__(self):
        super().__init__()
        self.setObjectName("memoryPanel")
        self.setFixedWidth(280)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 14, 16, 14)
        title = QLabel("<b>Memory</b>")
        self.where = QLabel("waiting for the engine…")
        self.where.setProperty("muted", True)
        self.where.setWordWrap(True)
        self.gauge = MemoryGauge()
        self.gauge.setMinimumHeight(14)
        grid = QGridLayout()
        grid.setHorizontalSpacing(8)
        self.values: dict[str, QLabel] = {}
        colours = {label: colour for _, label, colour in SEGMENTS}
        for row, label in enumerate(ROWS):
            key = QLabel(f'<span style="color:{colours[label]}">&#9632;</span> {label}')
            value = QLabel("–")
            value.setAlignment(Qt.AlignRight)
            grid.addWidget(key, row, 0)
            grid.addWidget(value, row, 1)
            self.values[label] = value
        self.precision = QLabel("KV precision: –")
        self.contexts = QLabel()
        self.contexts.setWordWrap(True)
        self.contexts.setTextFormat(Qt.RichText)
        for w in (title, self.where, self.gauge):
            layout.addWidget(w)
        layout.addLayout(grid)
        layout.addSpacing(8)
        layout.addWidget(self.precision)
        layout.addWidget(self.contexts)
        layout.addStretch(1)

    def show_snapshot(self, snapshot: dict) -> None:
        self.gauge.update_snapshot(snapshot)
        where = "System RAM (running on the CPU)" if snapshot["on_cpu"] else snapshot["device"]
        self.where.setText(f"{where}: {gib(snapshot['total'])}")
        for label, size, _ in segments(snapshot):
            self.values[label].setText(gib(size))
        self.precision.setText(f"KV precision: <b>{snapshot['precision']}</b>")

    def show_contexts(self, max_context: dict[str, int], trained: int | None) -> None:
        """``max_context``: the planner's largest context per precision on this machine."""
        rows = []
        for name, tokens in max_context.items():
            capped = trained is not None and tokens > trained
            shown = f"{min(tokens, trained) if capped else tokens:,}"
            rows.append(f"<tr><td>{name}</td><td align='right'>{shown}</td>"
                        f"<td>{' (trained limit)' if capped else ''}</td></tr>")
        self.contexts.setText("Largest context here:<table cellspacing='4'>" + "".join(rows) + "</table>")
