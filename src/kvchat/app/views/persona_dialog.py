"""The persona editor: a name and a system prompt."""
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLineEdit, QPlainTextEdit


class PersonaDialog(QDialog):
    def __init__(self, parent, persona: dict | None):
        super().__init__(parent)
        self.setWindowTitle("Persona")
        form = QFormLayout(self)
        self.name = QLineEdit(persona["name"] if persona else "")
        self.prompt = QPlainTextEdit(persona["system_prompt"] if persona else "")
        form.addRow("Name", self.name)
        form.addRow("System prompt", self.prompt)
        buttons = QDialogButtonBox(QDialogButtonBox.Ok | QDialogButtonBox.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        form.addRow(buttons)

    def values(self) -> tuple[str, str]:
        return self.name.text(), self.prompt.toPlainText()
