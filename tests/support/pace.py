"""How far the fake backend's reply may stream. Free by default; held, it gives a token only for a
credit the test gives; in lockstep (tests/app's ``lockstep``), the window gives one credit each time
it has taken a token, so a reply never runs ahead of what the window does with it (a Stop clicked on
the first token ends the reply at that token, on every run)."""
import threading


class Pace:
    def __init__(self):
        self._cond = threading.Condition()
        self._credits: int | None = None  # None: free
        self._lockstep = False
        self._current = None  # the request streaming now
        self._chunks: int | None = None  # prefill chunks allowed; None: free

    def hold(self) -> None:
        """From now on a token needs a credit (give)."""
        with self._cond:
            self._credits, self._lockstep = 0, False

    def lockstep(self) -> None:
        """A request may stream its first token; each later one once the window gave for the last."""
        with self._cond:
            self._credits, self._lockstep = 1, True

    def free(self) -> None:
        with self._cond:
            self._credits, self._lockstep = None, False
            self._cond.notify_all()

    def give(self, n: int = 1) -> None:
        """Held: ``n`` more tokens."""
        with self._cond:
            if self._credits is not None:
                self._credits += n
                self._cond.notify_all()

    def ack(self, handle) -> None:
        """In lockstep: the window has taken a token of ``handle``; its next one may come."""
        with self._cond:
            if self._lockstep and handle is self._current:
                self._credits += 1
                self._cond.notify_all()

    def hold_prefill(self, chunks: int = 0) -> None:
        """From now on a prefill chunk needs a credit (give_prefill); ``chunks`` are given now."""
        with self._cond:
            self._chunks = chunks

    def give_prefill(self, n: int = 1) -> None:
        with self._cond:
            if self._chunks is not None:
                self._chunks += n
                self._cond.notify_all()

    def take_chunk(self, handle) -> bool:
        """Wait for a prefill chunk's credit; False when the request was cancelled meanwhile."""
        with self._cond:
            while self._chunks is not None and self._chunks <= 0 and not handle.cancelled:
                self._cond.wait(1.0)  # every cancel path wakes it; the timeout is a safety net only
            if handle.cancelled:
                return False
            if self._chunks is not None:
                self._chunks -= 1
            return True

    def wake(self) -> None:
        """A cancel: the request waiting for a credit looks again."""
        with self._cond:
            self._cond.notify_all()

    def begin(self, handle) -> None:
        with self._cond:
            self._current = handle
            if self._lockstep:
                self._credits = 1

    def take(self, handle) -> bool:
        """Wait for a credit; False when the request was cancelled meanwhile."""
        with self._cond:
            while self._credits is not None and self._credits <= 0 and not handle.cancelled:
                self._cond.wait(1.0)  # every cancel path wakes it; the timeout is a safety net only
            if handle.cancelled:
                return False
            if self._credits is not None:
                self._credits -= 1
            return True
