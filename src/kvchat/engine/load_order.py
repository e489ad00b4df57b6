"""Which model load is the newest: each LoadModel gets a number; an older one is superseded, a
cancelled one stops at its next chunk, and requests taken while a newer load is on its way are
cancelled at once. Numbers are taken under the engine's lock; the rest is read on its thread."""


class LoadOrder:
    def __init__(self):
        self.asked = self.cancelled = self.loaded = 0  # the newest asked for; the newest cancelled; the model's

    def next(self) -> int:
        self.asked += 1
        return self.asked

    def cancel(self) -> None:
        """Stop the load under way or queued; the previous model comes back."""
        self.cancelled = self.asked

    def superseded(self, seq: int) -> bool:
        return seq < self.asked

    def switching(self) -> bool:
        """A newer model is on its way."""
        return self.asked > self.loaded

    def stop_reason(self, seq: int | None) -> str | None:
        """Why the load ``seq`` should stop now, or None (None: bringing the previous model back)."""
        if seq is None:
            return None
        if seq < self.asked:
            return "replaced by a later model choice"
        if seq <= self.cancelled:
            return "loading cancelled"
        return None

    def ended(self, seq: int) -> bool:
        """The load ``seq`` has ended: True (the engine is ready) unless a newer one is on its way."""
        if self.superseded(seq):
            return False
        self.loaded = seq
        return True
