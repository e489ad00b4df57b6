"""The top bar: chips for the model (name, size, weights), the context and the KV precision, each
opening the setting it names; chips that give way when the bar is narrow."""
from PySide6.QtCore import QEvent, QSize, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QStyle, QToolButton, QWidget

from kvchat.core.memory import parameter_counts

from kvchat.app.models.library_model import count


def size_label(config) -> str:
    """The model's parameters as the library counts them: what the load counted before int8/int4
    weights untied the config (that config counts a tied embedding twice: 163M for the 135M starter)."""
    n = getattr(config, "kvchat_parameter_count", None)
    try:
        n = n or sum(parameter_counts(config))
    except Exception:  # a config the planner cannot read still gets a chip, without a size
        return ""
    return count(n)  # as the library writes it


def model_name(source_label: str) -> str:
    if source_label.startswith("starter"):
        return "SmolLM2-135M-Instruct"
    return source_label.rstrip("/").split("/")[-1].removesuffix(".gguf")


class Chip(QToolButton):
    opened = Signal(str)  # the setting to open

    def __init__(self, setting: str, tip: str):
        super().__init__()
        self.setting = setting
        self.setProperty("chip", True)
        self.setToolTip(tip)
        self.setAutoRaise(True)
        self.clicked.connect(lambda: self.opened.emit(self.setting))


class TopBar(QFrame):
    """A row whose ``optional`` widgets (the first gives way last) show only while the rest fits
    beside them; ``roomy`` widgets that elide count at their roomy width there, not their minimum.

    Its minimum width leaves the optional widgets out. Counted in, they held a 1000 px window at
    1056 px (the minimum beat the resize) and, where the window was forced narrower, the layout
    squeezed the persona badge ("warm (in memo"); a rule on the window's width could not see that.
    """

    def __init__(self, row: QHBoxLayout, optional: list[QWidget], roomy: dict[QWidget, int], **kwargs):
        super().__init__(**kwargs)
        self.setLayout(row)
        self.optional, self.roomy = optional, roomy
        self.allowed = set(optional)  # an optional widget the window hides (the context on a server) stays hidden

    def allow(self, widget: QWidget, allowed: bool) -> None:
        (self.allowed.add if allowed else self.allowed.discard)(widget)
        self.fit()

    def minimumSizeHint(self) -> QSize:
        return QSize(self._row_width(roomy=False), super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:
        self.fit()
        super().resizeEvent(event)

    def event(self, event) -> bool:
        if event.type() == QEvent.LayoutRequest:  # a text changed: a chip or the badge wants other room
            self.fit()
        return super().event(event)

    def fit(self) -> None:
        """In order, each optional widget that fits in the room left; after one that does not, none."""
        room = self.width() - self._row_width(roomy=True)
        for widget in self.optional:
            show = False
            if widget in self.allowed:
                need = max(widget.sizeHint().width(), widget.minimumWidth()) + self._spacing()
                show = need <= room
                room = room - need if show else -1
            if widget.isHidden() == show:
                widget.setVisible(show)

    def _row_width(self, roomy: bool) -> int:
        """The row's width without the optional widgets: each other widget at its minimum (or its
        roomy width), the spacing between them and the margins, as the box layout counts them."""
        row = self.layout()
        widths = []
        for i in range(row.count()):
            item = row.itemAt(i)
            widget = item.widget()
            if item.isEmpty() or widget in self.optional:  # spacers and hidden widgets take no room
                continue
            width = item.minimumSize().width()
            if roomy and widget in self.roomy:
                width = max(width, min(self.roomy[widget], widget.sizeHint().width()))
            widths.append(width)
        margins = row.contentsMargins()
        return sum(widths) + self._spacing() * max(0, len(widths) - 1) + margins.left() + margins.right()

    def _spacing(self) -> int:
        spacing = self.layout().spacing()
        return spacing if spacing >= 0 else self.style().pixelMetric(QStyle.PM_LayoutHorizontalSpacing)
