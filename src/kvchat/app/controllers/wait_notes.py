"""Why a reply has no first token yet, said under it while its chat is in view: a long prompt's
prefill (how many of the prompt's tokens are computed, of how many, and about how long the rest
takes at the pace so far), or a decode step being captured (CUDA's warm-up notices). Stop ends a
prefill like a reply (the engine looks for a cancel between chunks)."""
import time

from PySide6.QtCore import QObject


WARMING_NOTE = "Preparing fast decoding for this model (up to a minute the first time): the reply starts after it."


def duration(seconds: float) -> str:
    if seconds < 60:
        return f"{max(1, round(seconds))} s"
    return f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


class WaitNotes(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win = win
        self.starts: dict[int, tuple[float, int]] = {}  # per reply key: when and where its pace is measured from
        self.warming = False  # a reply waits for the decode step's capture
        win.bridge.prefill.connect(self.on_progress)
        win.bridge.token.connect(lambda key, *_: self.on_token(key))
        win.bridge.finished.connect(lambda key, *_: self.clear(key))
        win.bridge.reply_failed.connect(lambda key, *_: self.clear(key))
        win.bridge.warming.connect(self.on_warming)

    def on_progress(self, key: int, done: int, total: int) -> None:
        now = time.monotonic()
        if done >= total:
            self.clear(key)
            return
        if key not in self.starts or done < self.starts[key][1]:
            self.starts[key] = (now, done)
        began, first = self.starts[key]
        rate = (done - first) / (now - began) if done > first and now > began else None
        left = f"about {duration((total - done) / rate)} left" if rate else "estimating the time left…"
        self.show(key, f"Reading your message: {done:,} of {total:,} tokens · {left}")

    def show(self, key: int, note: str) -> None:
        reply = self.win.replies.shown
        if reply is not None and reply.key == key:
            self.win.chat_view.model.set_note(note)

    def clear(self, key: int) -> None:
        """The reply's prompt is read, or it ended (a stop while it waits leaves the capture going)."""
        if self.starts.pop(key, None) is not None:
            self.show(key, "")

    def on_token(self, key: int) -> None:
        self.clear(key)
        if self.warming:  # a token: the decode step is ready, whatever the notices said
            self.warming = False
            self.note_warming()  # the reply in view may be another chat's, whose token comes next

    def on_warming(self, waits: bool) -> None:
        self.warming = waits
        self.note_warming()

    def note_warming(self) -> None:
        """Under the reply in view while it waits for the decode step: why."""
        reply = self.win.replies.shown
        if reply is not None and not reply.text:
            self.win.chat_view.model.set_note(WARMING_NOTE if self.warming else "")
