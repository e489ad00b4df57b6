"""What the app's QML list models share: rows of dicts, exposed to QML under named roles."""
from PySide6.QtCore import QAbstractListModel, QByteArray, QModelIndex, Qt


def role_ids(roles) -> dict[str, int]:
    return {name: Qt.UserRole + 1 + i for i, name in enumerate(roles)}


class RowModel(QAbstractListModel):
    """``ROLE_IDS`` (from role_ids) names a subclass's roles; ``rows`` holds its rows."""

    ROLE_IDS: dict[str, int] = {}

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[dict] = []

    def roleNames(self) -> dict:
        return {rid: QByteArray(name.encode()) for name, rid in self.ROLE_IDS.items()}

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)
