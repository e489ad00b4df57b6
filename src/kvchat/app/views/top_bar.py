"""The top bar: chips for the model (name, size, weights), the context and the memory saving, each
opening the setting it names. When the bar is narrow the chips first say less (their short text),
then the optional ones move into the overflow menu ("⋯"), which opens the same settings: nothing
vanishes, nothing is cut mid-word."""
from PySide6.QtCore import QEvent, QSize, Qt, Signal
from PySide6.QtGui import QAction, QPainter
from PySide6.QtWidgets import QFrame, QHBoxLayout, QMenu, QStyle, QStyleOptionToolButton, QToolButton, QWidget

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
        self.full = self.short = ""
        self.compact = False
        self.setProperty("chip", True)
        self.setToolTip(tip)
        self.setAutoRaise(True)
        self.clicked.connect(lambda: self.opened.emit(self.setting))

    def setText(self, text: str, short: str | None = None) -> None:
        """``short``: what it says when the bar is narrow (by default, the same)."""
        self.full, self.short = text, short or text
        super().setText(self.short if self.compact else self.full)

    def width_for(self, text: str) -> int:
        """Its width with ``text``, without setting it (a text set and set back costs a relayout)."""
        fm = self.fontMetrics()
        return self.sizeHint().width() - fm.horizontalAdvance(self.text()) + fm.horizontalAdvance(text)

    def drawn_text(self) -> str:
        """Its text as painted: cut at the end when the chip is narrower than it asks, never in the
        middle (the style's way, which made "Smo…uto" of a model name and its weights)."""
        opt = QStyleOptionToolButton()
        self.initStyleOption(opt)
        room = self.style().subControlRect(QStyle.CC_ToolButton, opt, QStyle.SC_ToolButton, self).width()
        padding = self.sizeHint().width() - self.fontMetrics().horizontalAdvance(self.text())
        return self.fontMetrics().elidedText(self.text(), Qt.ElideRight, max(0, room - padding))

    def paintEvent(self, event) -> None:
        if self.width() >= self.sizeHint().width():  # the whole text fits: the style draws it as it is
            super().paintEvent(event)
            return
        opt = QStyleOptionToolButton()
        self.initStyleOption(opt)
        opt.text = self.drawn_text()
        painter = QPainter(self)
        self.style().drawComplexControl(QStyle.CC_ToolButton, opt, painter, self)
        painter.end()

    def set_compact(self, compact: bool) -> None:
        if compact != self.compact:
            self.compact = compact
            super().setText(self.short if compact else self.full)


def wanted_width(widget: QWidget, compact: bool) -> int:
    """A widget's wanted width; a chip's with its short or full text."""
    if isinstance(widget, Chip):
        return widget.width_for(widget.short if compact else widget.full)
    return widget.sizeHint().width()


class TopBar(QFrame):
    """A row whose ``optional`` widgets (the first gives way last) show only while the rest fits
    beside them, and otherwise sit in ``more``'s menu; ``roomy`` widgets that elide count at their
    roomy width there, not their minimum. Before any goes, every chip takes its short text.

    Its minimum width leaves the optional widgets out. Counted in, they held a 1000 px window at
    1056 px (the minimum beat the resize) and, where the window was forced narrower, the layout
    squeezed the persona badge; a rule on the window's width could not see that.
    """

    def __init__(self, row: QHBoxLayout, optional: list[QWidget], roomy: dict[QWidget, int], more: QToolButton,
                 **kwargs):
        super().__init__(**kwargs)
        self.setLayout(row)
        self.optional, self.roomy, self.more = optional, roomy, more
        self.allowed = set(optional)  # an optional widget the window hides (the context on a server) stays hidden
        more.setMenu(QMenu(more))
        more.setPopupMode(QToolButton.InstantPopup)
        more.menu().aboutToShow.connect(self._fill_menu)
        more.hide()
        self._fitting = False

    def chips(self) -> list[Chip]:
        row = self.layout()
        return [row.itemAt(i).widget() for i in range(row.count()) if isinstance(row.itemAt(i).widget(), Chip)]

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
        if self._fitting:  # a chip's new text posts a layout request of its own
            return
        self._fitting = True
        try:
            # planned from the texts' widths, then applied once: each Qt call here is made only when
            # something changes (a fit runs on every relayout)
            compact = not self._place(compact=False, apply=False)
            for chip in self.chips():
                chip.set_compact(compact)
            self._place(compact=compact, apply=True)
        finally:
            self._fitting = False

    def _place(self, compact: bool, apply: bool) -> bool:
        """In order, each optional widget that fits in the room left; after one that does not, none,
        and the overflow button instead. True when every allowed one is shown. Chips count with
        their short (``compact``) or full text; roomy ones in full unless compact."""
        more = self.more.sizeHint().width() + self._spacing()
        room = self.width() - self._row_width(roomy=True, whole=not compact)
        need = [max(wanted_width(w, compact), w.minimumWidth()) + self._spacing() for w in self.optional]
        everything = room >= sum(n for w, n in zip(self.optional, need) if w in self.allowed)
        if not apply:
            return everything
        if not everything:
            room -= more
        for widget, n in zip(self.optional, need):
            show = widget in self.allowed and n <= room
            room = room - n if show else -1
            if widget.isHidden() == show:
                widget.setVisible(show)
        if self.more.isHidden() != everything:
            self.more.setHidden(everything)
        return everything

    def _fill_menu(self) -> None:
        """What the bar has no room for, as the chips would say it."""
        menu = self.more.menu()
        menu.clear()
        for widget in self.optional:
            if widget in self.allowed and widget.isHidden():
                action = QAction(getattr(widget, "full", "") or widget.toolTip(), menu)
                action.setToolTip(widget.toolTip())
                action.triggered.connect(widget.click)
                menu.addAction(action)

    def _row_width(self, roomy: bool, whole: bool = False) -> int:
        """The row's width without the optional widgets and the overflow button: each other widget
        at its minimum (or its roomy width), the spacing between them and the margins."""
        row = self.layout()
        widths = []
        for i in range(row.count()):
            item = row.itemAt(i)
            widget = item.widget()
            if item.isEmpty() or widget in self.optional or widget is self.more:  # spacers and hidden widgets: no room
                continue
            width = item.minimumSize().width()
            if roomy and widget in self.roomy:
                hint = wanted_width(widget, not whole)
                width = max(width, hint if whole else min(self.roomy[widget], hint))
            widths.append(width)
        margins = row.contentsMargins()
        return sum(widths) + self._spacing() * max(0, len(widths) - 1) + margins.left() + margins.right()

    def _spacing(self) -> int:
        spacing = self.layout().spacing()
        return spacing if spacing >= 0 else self.style().pixelMetric(QStyle.PM_LayoutHorizontalSpacing)
