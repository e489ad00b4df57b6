"""The top bar's count of the replies being written, in every chat: hidden while none is; a click
opens the next chat that has one (the window connects it)."""
from PySide6.QtWidgets import QToolButton


class RunningButton(QToolButton):
    def __init__(self):
        super().__init__(autoRaise=True, objectName="running")
        self.hide()

    def show_titles(self, titles: list[str]) -> None:
        """``titles``: the chats with a reply being written."""
        self.setVisible(bool(titles))
        self.setText(f"{len(titles)} repl{'y' if len(titles) == 1 else 'ies'} running")
        self.setToolTip("Being written in: " + ", ".join(f"“{t}”" for t in titles) + ". Click to open the next one.")
