"""The persona editor: a name and a system prompt; an existing persona can be deleted from it."""
from PySide6.QtWidgets import QDialog, QDialogButtonBox, QFormLayout, QLineEdit, QPlainTextEdit

DELETE = 2  # the dialog's result when Delete was pressed (Accepted is 1, Rejected 0)


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
        if persona is not None:
            self.delete_button = buttons.addButton("Delete persona…", QDialogButtonBox.DestructiveRole)
            self.delete_button.setObjectName("deletePersona")
            self.delete_button.clicked.connect(lambda: self.done(DELETE))
        form.addRow(buttons)

    def values(self) -> tuple[str, str]:
        return self.name.text(), self.prompt.toPlainText()
