"""A combo box that shows plain words and answers with the setting's value: currentText and
setCurrentText speak values ("int8"), the user reads labels ("moderate"), and each item's tooltip
names the expert term."""
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox


class ValueCombo(QComboBox):
    def __init__(self, labels: dict[str, str], tips: dict[str, str] | None = None):
        super().__init__()
        for value, label in labels.items():
            self.addItem(label, value)
            if tips and value in tips:
                self.setItemData(self.count() - 1, tips[value], Qt.ToolTipRole)

    def currentText(self) -> str:
        return self.currentData() or super().currentText()

    def setCurrentText(self, value: str) -> None:
        index = self.findData(value)
        if index >= 0:
            self.setCurrentIndex(index)
