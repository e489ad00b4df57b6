"""Personas: the box at the top, the editor, and the badge that says whether the persona's prefix is
in the KV cache."""
from PySide6.QtCore import QObject

from kvchat.app.views.persona_badge import LABELS, BadgeAsker
from kvchat.app.views.persona_dialog import DELETE, PersonaDialog
from kvchat.app.views.sheet import confirm
from kvchat.app.views.theme import COLOURS

TOOLTIPS = {"warm": "This persona's prefix is in the KV cache: it is not computed again.",
            "disk": "This persona's prefix is saved on disk: it is restored, not computed.",
            "cold": "This persona's prefix would be computed for the next reply.",
            "short": "No persona prefix long enough to cache.",
            "server": "The server keeps its own prefix cache: the persona is sent byte-identical every time, "
                      "so that it hits there."}


class PersonaController(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store = win, win.store
        self.asker = BadgeAsker()
        self.asker.answered.connect(self.on_badge)

    def current(self) -> int | None:
        return self.win.persona_box.currentData()

    def persona(self, persona_id: int | None) -> dict | None:
        return next((p for p in self.store.personas() if p["id"] == persona_id), None)

    def show(self, persona_id: int | None) -> None:
        """The box shows the open chat's persona, without counting as the user's choice."""
        box = self.win.persona_box
        box.blockSignals(True)
        box.setCurrentIndex(max(0, box.findData(persona_id)))
        box.blockSignals(False)
        self.update_badge()

    def on_chosen(self, _index) -> None:
        win = self.win
        if win.conversation_id is not None:
            self.store.set_persona(win.conversation_id, self.current())
        self.update_badge()
        win.render_chat()

    def reload(self, select: int | None = None) -> None:
        box = self.win.persona_box
        current = select if select is not None else box.currentData()
        box.blockSignals(True)
        box.clear()
        for persona in self.store.personas():
            box.addItem(persona["name"], persona["id"])
        box.setCurrentIndex(max(0, box.findData(current)))
        box.blockSignals(False)

    def edit(self, new: bool) -> None:
        persona = None if new else self.persona(self.current())
        dialog = PersonaDialog(self.win, persona)
        result = dialog.exec()
        if result == DELETE:
            self.delete(persona)
        elif result:
            self.save(persona["id"] if persona else None, *dialog.values())

    def save(self, persona_id: int | None, name: str, prompt: str) -> None:
        """A changed prompt is a new prefix: the old one's cache simply goes cold."""
        try:
            if persona_id is None:
                persona_id = self.store.add_persona(name, prompt)
            else:
                self.store.update_persona(persona_id, name, prompt)
        except ValueError as e:
            self.win.show_error(f"Could not save the persona: {e}")
            return
        self.reload(select=persona_id)
        self.on_chosen(None)

    def delete(self, persona: dict) -> None:
        """After a confirmation: the replies it wrote keep their text and its name (the store keeps a
        reply's author); chats that used it go on without one, the open chat with the one now shown."""
        if not confirm(self.win, "Delete persona", f"Delete the persona “{persona['name']}”? Chats that used it "
                       "keep their replies, under its name.", "Delete persona"):
            return
        self.store.delete_persona(persona["id"])
        self.reload()
        self.on_chosen(None)
        self.win.notify(f"persona “{persona['name']}” deleted")

    def update_badge(self) -> None:
        """Asks the backend whether the persona's prefix is in the pool or on disk; on_badge shows it."""
        win, bridge = self.win, self.win.bridge
        persona = self.persona(self.current())
        if bridge.loading or bridge.load_error:
            win.persona_badge.setText("")
            return
        if win.persona_badge.property("persona") != self.current():
            win.persona_badge.setText("…")
        self.asker.ask(bridge.engine, persona and persona["id"], persona and persona["system_prompt"])

    def on_badge(self, persona_id, state: str) -> None:
        badge = self.win.persona_badge
        if persona_id != self.current():
            return  # answered for a persona no longer shown
        badge.setProperty("persona", persona_id)
        badge.setProperty("state", state)
        badge.setText(LABELS[state])
        badge.setToolTip(TOOLTIPS[state])
        colours = COLOURS[self.win.theme.dark]
        badge.setStyleSheet(f"color: {colours['warm' if state in ('warm', 'disk', 'server') else 'cold']};")
