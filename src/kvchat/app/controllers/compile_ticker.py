"""The background compile's progress on the notice line: how long it has run, beside what it took
here the last time (the engine's "warm-up" notice says that), updated every second until fast
decoding is ready or the model changes. Replies meanwhile decode eagerly, slower: the line tells a
user why, and that it is moving."""
import time

from PySide6.QtCore import QObject, QTimer

from kvchat.core.events import PREPARING

WARM_UP = "warm-up: "  # the notice line's prefix for the engine's warm-up notices (MainWindow.on_notice)


def elapsed(seconds: float) -> str:
    return f"{int(seconds) // 60}:{int(seconds) % 60:02d}"


class CompileTicker(QObject):
    def __init__(self, win):
        super().__init__(win)
        self.win = win
        self.started: float | None = None
        self.message = ""
        self.shown = ""  # the line as the last tick wrote it
        self.timer = QTimer(self, interval=1000)
        self.timer.timeout.connect(self.tick)

    def on_notice(self, kind: str, message: str) -> None:
        if kind == "warm-up" and message.startswith(PREPARING):
            self.started, self.message, self.shown = time.monotonic(), message, ""
            self.timer.start()
        elif kind in ("warm-up", "eager") and self.started is not None:  # ready, or it fell back
            self.stop()

    def stop(self) -> None:
        self.started = None
        self.timer.stop()

    def tick(self) -> None:
        """The line shows the time so far while it still shows this compile (another notice may
        have taken it: that one stays)."""
        if self.started is None:
            return
        label = self.win.notice_label
        if label.text() in (WARM_UP + self.message, self.shown):  # first: a narrow line elides its end
            self.shown = f"{WARM_UP}{elapsed(time.monotonic() - self.started)} so far · {self.message}"
            label.setText(self.shown)
