"""What the memory panel says of the chat rather than of the machine: this conversation's tokens
against the context (from its last reply's stats: the prompt it was given and what it wrote), and
what the prefix cache saved today (prompt tokens served from the cache, not computed), summed over
the replies' stats and kept per day in the settings."""
import datetime

from PySide6.QtCore import QObject

SAVED_KEY = "prefix_cache_saved"


def today() -> str:
    return datetime.date.today().isoformat()


class MemoryTally(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store, self.bridge = win, win.store, win.bridge
        self.bridge.finished.connect(self.on_finished)
        self.bridge.ready.connect(self.show)
        self.bridge.reconfigured.connect(lambda _: self.show())
        win.chat_view.model.modelReset.connect(self.show)  # another chat opened (a send or a reply's end: render_chat)

    def saved_today(self) -> int:
        saved = self.store.setting(SAVED_KEY) or {}
        return saved.get("tokens", 0) if saved.get("day") == today() else 0

    def on_finished(self, _key: int, result: dict) -> None:
        stats = result.get("stats") or {}
        if stats.get("cached_tokens") and stats.get("cached_reported", True):
            self.store.set_setting(SAVED_KEY, {"day": today(), "tokens": self.saved_today() + stats["cached_tokens"]})
        self.show()

    def conversation_tokens(self) -> int | None:
        """The last reply's prompt and generated tokens: the conversation as the model last held it."""
        cid = self.win.conversation_id
        if cid is None:
            return None
        for m in reversed(self.store.messages(cid)):
            if m.role == "assistant" and m.stats and m.stats.get("prompt_tokens"):
                return m.stats["prompt_tokens"] + m.stats.get("generated_tokens", 0)
        return None

    def show(self) -> None:
        context = self.bridge.settings.get("max_context") if self.bridge.capabilities.memory else None
        self.win.memory_panel.show_chat(self.conversation_tokens(), context, self.saved_today())
