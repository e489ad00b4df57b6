"""The persona badge's answer, asked of the engine off the GUI thread and handed back as a signal."""
import threading

from PySide6.QtCore import QObject, Signal

# plain words: whether the persona's prompt is already computed (its KV cached), the tooltip says more
LABELS = {"warm": "ready in memory", "disk": "ready, saved on disk", "cold": "not prepared yet",
          "short": "too short to prepare", "server": "cached by the server"}


class BadgeAsker(QObject):
    answered = Signal(object, str)  # persona id, state

    def ask(self, engine, persona_id: int | None, system_prompt: str | None) -> None:
        if persona_id is None or not system_prompt:
            self.answered.emit(persona_id, "short")
            return

        def run():
            try:
                state = engine.persona_state(system_prompt)
            except Exception:  # a pool being rebuilt, an engine still starting: ask again next time
                return
            self.answered.emit(persona_id, state)

        threading.Thread(target=run, daemon=True).start()
