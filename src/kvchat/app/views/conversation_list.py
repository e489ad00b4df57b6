"""The sidebar's chats, newest first, under date headings (Today, Yesterday, Previous 7 days,
Previous 30 days, Older). Headings are items that cannot be selected."""
import datetime as dt

from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QListWidget, QListWidgetItem


def group_of(updated: float, today: dt.date) -> str:
    days = (today - dt.date.fromtimestamp(updated)).days
    if days <= 0:
        return "Today"
    if days == 1:
        return "Yesterday"
    if days <= 7:
        return "Previous 7 days"
    if days <= 30:
        return "Previous 30 days"
    return "Older"


class ConversationList(QListWidget):
    def __init__(self):
        super().__init__()
        self.setObjectName("conversations")
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarAlwaysOff)
        self.setTextElideMode(Qt.ElideRight)

    def fill(self, conversations: list[dict], current: int | None, today: dt.date | None = None) -> None:
        today = today or dt.date.today()
        self.blockSignals(True)
        self.clear()
        heading = None
        for conv in conversations:
            group = group_of(conv["updated"], today)
            if group != heading:
                heading = group
                self.addItem(self._heading(group))
            item = QListWidgetItem(conv["title"])
            item.setData(Qt.UserRole, conv["id"])
            item.setToolTip(conv["title"])
            self.addItem(item)
            if conv["id"] == current:
                self.setCurrentItem(item)
        self.blockSignals(False)

    def select(self, conversation_id: int) -> None:
        """Highlight that chat, without the signal a user's click gives; none when a search hides it,
        so that no other chat looks open (and a click on that one opens it)."""
        item = next((i for i in self.chat_items() if i.data(Qt.UserRole) == conversation_id), None)
        if item is not self.currentItem():
            self.blockSignals(True)
            self.setCurrentItem(item)
            self.blockSignals(False)

    def _heading(self, text: str) -> QListWidgetItem:
        item = QListWidgetItem(text)
        item.setFlags(Qt.NoItemFlags)
        font = QFont(self.font())
        font.setPointSizeF(font.pointSizeF() * 0.85)
        font.setBold(True)
        item.setFont(font)
        item.setData(Qt.UserRole, None)
        return item

    def headings(self) -> list[str]:
        return [self.item(i).text() for i in range(self.count()) if self.item(i).data(Qt.UserRole) is None]

    def chat_items(self) -> list[QListWidgetItem]:
        return [self.item(i) for i in range(self.count()) if self.item(i).data(Qt.UserRole) is not None]
