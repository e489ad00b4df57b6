"""The sidebar's chats: list, search, new, open, rename, delete, export. The open chat is the window's
``conversation_id``; everything is saved in the store at once."""
from pathlib import Path

from PySide6.QtCore import QObject, QStandardPaths, Qt
from PySide6.QtWidgets import QFileDialog

from kvchat.app.store import engine_messages
from kvchat.app.views.sheet import ask_text, confirm, give_keys_back

STREAMING_NOTICE = "a reply is being written in this chat: stop it (Escape) before deleting the chat"
NOT_IN_FILE_NAMES = '/\\:*?"<>|'


def export_folder() -> Path:
    """The user's Documents folder (the launch folder was a surprise), else home: a folder that is
    not there would send the file dialog back to the launch folder."""
    documents = QStandardPaths.writableLocation(QStandardPaths.DocumentsLocation)
    return Path(documents) if documents and Path(documents).is_dir() else Path.home()


def file_name(title: str, suffix: str) -> str:
    """A chat's title as a file name that every desktop's file system takes."""
    name = "".join(" " if ch in NOT_IN_FILE_NAMES or ord(ch) < 32 else ch for ch in title)
    name = " ".join(name.split()).strip(". ")[:80]
    return (name or "chat") + suffix


class ConversationController(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store = win, win.store

    def refresh(self) -> None:
        self.win.conversation_list.fill(self.store.conversations(self.win.search.text()), self.win.conversation_id)

    def new(self) -> int:
        """A new chat, or the open one if it has no message yet: clicking twice makes one, not two
        empty chats that outlive a restart."""
        win = self.win
        win.replies.stop_editing()
        win.replies.leave()
        if win.conversation_id is not None and not self.store.messages(win.conversation_id):
            win.input.setFocus()
            return win.conversation_id
        win.conversation_id = self.store.create_conversation("New chat", win.persona_box.currentData())
        self.refresh()
        win.render_chat()
        win.input.setFocus()
        return win.conversation_id

    def open(self, conversation_id: int) -> None:
        win = self.win
        win.replies.stop_editing()
        win.replies.leave()
        win.conversation_id = conversation_id
        win.conversation_list.select(conversation_id)  # opened from elsewhere than the list: the list follows
        win.personas.show(self.store.conversation(conversation_id)["persona_id"])
        win.render_chat()

    def on_select(self, item, _previous) -> None:
        # the view follows the highlight even while a reply streams (into its own chat), so the list and
        # the view never name different chats
        if item is not None and item.data(Qt.UserRole) is not None:
            self.open(item.data(Qt.UserRole))

    def rename(self) -> None:
        cid = self.win.conversation_id
        if cid is None:
            return
        title = ask_text(self.win, "Rename chat", "The chat's new title, as the list shows it.",
                         self.store.conversation(cid)["title"], action="Rename")
        if title:
            self.store.rename_conversation(cid, title)
            self.refresh()
            self.win.replies.update_buttons()  # the running replies' tooltip names the chats

    def delete(self) -> None:
        """Deletes the open chat, the one in view, after a confirmation that names it. No parameter:
        the button's clicked(bool) must have nothing to fill."""
        win, doomed = self.win, self.win.conversation_id
        if doomed is None:
            return
        if win.replies.of(doomed) is not None:
            win.notify(STREAMING_NOTICE)
            return
        title = self.store.conversation(doomed)["title"]
        if not confirm(win, "Delete chat", f"Delete “{title}” for good? Its messages and its cached memory go.",
                       "Delete chat"):
            return
        messages = engine_messages(self.store.messages(doomed), win.replies.persona_of(doomed))
        self.store.delete_conversation(doomed)
        if len(messages) > 1 or messages and messages[0]["role"] != "system":
            win.bridge.forget(messages)  # its KV is its text in another form: gone from every tier too
        if win.replies.waiting == doomed:
            win.replies.waiting = None
        win.conversation_id = None
        self.refresh()
        win.render_chat()

    def export_dialog(self) -> None:
        if self.win.conversation_id is None:
            return
        title = self.store.conversation(self.win.conversation_id)["title"]
        path, _ = QFileDialog.getSaveFileName(self.win, "Export chat", str(export_folder() / file_name(title, ".md")),
                                              "Markdown (*.md);;JSON (*.json)")
        give_keys_back(self.win)
        if path:
            self.export_to(Path(path))

    def export_to(self, path: Path) -> None:
        export = self.store.export_json if path.suffix == ".json" else self.store.export_markdown
        path.write_text(export(self.win.conversation_id), encoding="utf-8")
        self.win.notify(f"exported to {path}")
