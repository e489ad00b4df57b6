"""A long prompt's prefill, shown while the reply waits for its first token: how many of the
prompt's tokens are computed, of how many, and about how long the rest takes at the pace so far,
under the reply. Stop ends it like a reply (the engine looks for a cancel between chunks)."""
import time

from PySide6.QtCore import QObject


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


class PrefillMeter(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win = win
        self.start: tuple[float, int] | None = None  # when and where the pace is measured from
        self.shown = False
        win.bridge.prefill.connect(self.on_progress)
        win.bridge.token.connect(lambda *_: self.clear())
        win.bridge.finished.connect(lambda *_: self.clear())
        win.bridge.failed.connect(lambda *_: self.clear())

    def on_progress(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total:
            self.clear()
            return
        if self.start is None or done < self.start[1]:
            self.start = (now, done)
        began, first = self.start
        rate = (done - first) / (now - began) if done > first and now > began else None
        left = f"about {duration((total - done) / rate)} left" if rate else "estimating the time left…"
        self.show(f"Reading your message: {done:,} of {total:,} tokens · {left}")

    def show(self, note: str) -> None:
        replies = self.win.replies
        if replies.reply_id is not None and replies.conversation == self.win.conversation_id:
            self.win.chat_view.model.set_note(note)
            self.shown = True

    def clear(self) -> None:
        self.start = None
        if self.shown:
            self.shown = False
            self.win.chat_view.model.set_note("")
