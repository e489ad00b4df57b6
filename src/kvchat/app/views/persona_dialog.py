"""The persona editor: a name and a system prompt; an existing persona can be deleted from it."""
from PySide6.QtWidgets import QDialogButtonBox, QFormLayout, QLineEdit, QPlainTextEdit

from kvchat.app.views.sheet import Sheet

DELETE = 2  # the dialog's result when Delete was pressed (Accepted is 1, Rejected 0)


class PersonaDialog(Sheet):
    def __init__(self, parent, persona: dict | None):
        super().__init__(parent, "Edit persona" if persona else "New persona",
                         "Who the model is in every chat that uses this persona: its name, and the system prompt "
                         "it reads first. kvchat keeps that prompt's memory, so it is not read again.")
        form = self.card(QFormLayout)
        self.name = QLineEdit(persona["name"] if persona else "")
        self.prompt = QPlainTextEdit(persona["system_prompt"] if persona else "")
        self.prompt.setMinimumSize(440, 160)
        form.addRow("Name", self.name)
        form.addRow("System prompt", self.prompt)
        if persona is not None:
            self.delete_button = self.button("Delete persona…", QDialogButtonBox.DestructiveRole, "plain")
            self.delete_button.setObjectName("deletePersona")
            self.delete_button.clicked.connect(lambda: self.done(DELETE))
        self.button("Cancel", QDialogButtonBox.RejectRole, "plain")
        self.save_button = self.button("Save", QDialogButtonBox.AcceptRole, "accent")
        self.save_button.setDefault(True)

    def values(self) -> tuple[str, str]:
        return self.name.text(), self.prompt.toPlainText()
