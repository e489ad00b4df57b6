"""Spots a reply caught in a loop: its last WINDOW tokens already appeared, verbatim, earlier in the
same reply. Constant work per token (one hash of a window held in a set)."""
WINDOW = 64


class LoopGuard:
    def __init__(self, window: int = WINDOW):
        self.window = window
        self.ids: list[int] = []
        self.seen: set[tuple[int, ...]] = set()

    def add(self, token_id: int) -> bool:
        """True once the newest ``window`` tokens repeat an earlier stretch of the reply."""
        self.ids.append(token_id)
        if len(self.ids) < self.window:
            return False
        tail = tuple(self.ids[-self.window:])
        if tail in self.seen:
            return True
        self.seen.add(tail)
        return False
