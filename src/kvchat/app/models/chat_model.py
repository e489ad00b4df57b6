"""The open conversation as a list model for the QML chat view. A streaming reply changes one row,
and only that row's blocks are rebuilt; the other messages keep what they rendered."""
from PySide6.QtCore import QModelIndex, Qt, Signal

from kvchat.app.models.attachments import chip, decode
from kvchat.app.models.blocks import blocks, stats_line
from kvchat.app.models.row_model import RowModel, role_ids

ROLES = ["role", "author", "content", "blocks", "position", "interrupted", "stats", "streaming", "lastReply", "note",
         "version", "versions"]
ROLES.append("attachments")  # a user message's pasted documents, as chips (models/attachments.py)
ROLES.append("unanswered")  # the chat's last message is the user's: its reply was stopped before a word, or never came
ROLE_IDS = role_ids(ROLES)
LAST_ROW = {ROLE_IDS["lastReply"]: "assistant", ROLE_IDS["unanswered"]: "user"}  # true on the last row of that role


def with_attachments(row: dict) -> dict:
    """A user message shows its typed text in the bubble and each pasted document as a chip."""
    row["attachments"] = []
    if row["role"] == "user":
        row["content"], found = decode(row["content"])
        row["attachments"] = [chip(name, text) for name, text in found]
    return row


class ChatModel(RowModel):
    ROLE_IDS = ROLE_IDS
    follow = Signal()  # the view goes to the newest message and follows it (a reset, a message sent)

    def __init__(self, dark: bool = False):
        super().__init__()
        self.dark = dark
        self.author = "Assistant"

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role == ROLE_IDS["blocks"]:
            if row["blocks"] is None:  # rendered when first shown: a long chat opens at the cost of a screenful
                row["blocks"] = blocks(row["content"], self.dark, row["streaming"]) if row["role"] == "assistant" else []
            return row["blocks"]
        if role in LAST_ROW:
            return index.row() == len(self.rows) - 1 and row["role"] == LAST_ROW[role]
        if role == Qt.DisplayRole:
            return row["content"]
        name = next((n for n, rid in ROLE_IDS.items() if rid == role), None)
        return row.get(name) if name else None

    def reset(self, messages, author: str, streaming_id: int | None = None, streaming_text: str = "") -> None:
        """``messages``: the store's rows. The streaming reply shows ``streaming_text``, not its last save."""
        self.beginResetModel()
        self.author = author
        self.rows = [with_attachments(self._row(m, author, m.id == streaming_id, streaming_text)) for m in messages]
        self.endResetModel()
        self.follow.emit()  # another chat, or the same one changed in the middle: shown from its end

    def refresh(self, messages, author: str, streaming_id: int | None = None, streaming_text: str = "") -> None:
        """As ``reset``, but when the same messages are shown, and maybe new ones after them (a
        message sent, a reply ended), only the rows that changed or came render. A reset rendered
        every row in view again, and at a reply's end pulled a reader who had scrolled up to the
        end (``kvchat bench ui``, runs taken in turns: a reset at both 1.8-2.45 ms a token, at
        neither 1.33-1.81)."""
        rows = [with_attachments(self._row(m, author, m.id == streaming_id, streaming_text)) for m in messages]
        n = len(self.rows)
        if [r["id"] for r in rows[:n]] != [r["id"] for r in self.rows]:
            return self.reset(messages, author, streaming_id, streaming_text)
        self.author = author
        for i, (old, new) in enumerate(zip(self.rows, rows)):
            if {**old, "blocks": None} != new:
                self.rows[i] = new
                self.dataChanged.emit(self.index(i), self.index(i))
        if len(rows) > n:
            self.beginInsertRows(QModelIndex(), n, len(rows) - 1)
            self.rows.extend(rows[n:])
            self.endInsertRows()
            if n:  # the row that was last is no longer: its Regenerate (or Retry) goes
                self.dataChanged.emit(self.index(n - 1), self.index(n - 1), list(LAST_ROW))

    def _row(self, m, author: str, live: bool, live_text: str) -> dict:
        # a reply keeps the name of the persona that wrote it; ``author`` names only one without
        return {"id": m.id, "role": m.role, "author": (m.author or author) if m.role == "assistant" else "You",
                "content": live_text if live else m.content, "blocks": None, "position": m.position,
                "interrupted": m.interrupted and not live, "streaming": live,
                "stats": "" if live or not m.stats else stats_line(m.stats), "note": "",
                "version": m.version, "versions": m.versions}

    def row_of(self, message_id: int) -> int:
        return next((i for i, r in enumerate(self.rows) if r["id"] == message_id), -1)

    def set_text(self, message_id: int, text: str) -> None:
        """The streaming reply's text so far: one row changes."""
        i = self.row_of(message_id)
        if i < 0 or self.rows[i]["content"] == text:
            return
        self.rows[i]["content"], self.rows[i]["blocks"] = text, None
        index = self.index(i)
        self.dataChanged.emit(index, index, [ROLE_IDS["content"], ROLE_IDS["blocks"]])

    def set_dark(self, dark: bool) -> None:
        """Code colours differ per theme: every row renders again, when next shown."""
        if dark != self.dark:
            self.dark = dark
            for r in self.rows:
                r["blocks"] = None
            if self.rows:
                self.dataChanged.emit(self.index(0), self.index(len(self.rows) - 1), [ROLE_IDS["blocks"]])

    def set_note(self, note: str) -> None:
        """A line under the last message (it waits for the model to load)."""
        if self.rows:
            self.rows[-1]["note"] = note
            index = self.index(len(self.rows) - 1)
            self.dataChanged.emit(index, index, [ROLE_IDS["note"]])
