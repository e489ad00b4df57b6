"""The model library: the models already on disk, what each is, and whether it fits here (the
planner's verdict) before anything loads; one click loads one. Scanning reads only configs and GGUF
headers, on a worker thread."""
import threading

from PySide6.QtCore import QObject, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QFileDialog, QHBoxLayout, QHeaderView, QLabel,
                               QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout)

from kvchat.engine.model_library import describe, scan, verdict

COLUMNS = ["Model", "Source", "Architecture", "Parameters", "Size", "Trained context", "On this machine"]


def count(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


class Scanner(QObject):
    found = Signal(list)

    def start(self, folders: list[str], roots=None) -> None:
        threading.Thread(target=lambda: self.found.emit(scan(folders, roots)), daemon=True).start()


class ModelLibrary(QDialog):
    """``chosen`` carries the path to load."""
    chosen = Signal(str)

    def __init__(self, parent, folders: list[str], memory: int | None, on_cuda: bool, roots=None):
        super().__init__(parent)
        self.setWindowTitle("Models on this computer")
        self.resize(980, 460)
        self.folders, self.memory, self.on_cuda, self.roots = list(folders), memory, on_cuda, roots
        self.models = []
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(COLUMNS)
        self.table.setSelectionBehavior(QAbstractItemView.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SingleSelection)
        self.table.setEditTriggers(QAbstractItemView.NoEditTriggers)
        self.table.verticalHeader().hide()
        self.table.horizontalHeader().setSectionResizeMode(0, QHeaderView.Stretch)
        self.table.doubleClicked.connect(lambda _: self.load_selected())
        self.status = QLabel("Looking for models…")
        self.status.setProperty("muted", True)
        self.add_button, self.open_button, self.load_button = (
            QPushButton(t) for t in ("Add folder…", "Open .gguf…", "Load"))
        self.load_button.setDefault(True)
        self.add_button.clicked.connect(self.add_folder)
        self.open_button.clicked.connect(self.open_file)
        self.load_button.clicked.connect(self.load_selected)
        buttons = QHBoxLayout()
        for b in (self.add_button, self.open_button):
            buttons.addWidget(b)
        buttons.addStretch(1)
        buttons.addWidget(self.load_button)
        layout = QVBoxLayout(self)
        layout.addWidget(self.table, 1)
        layout.addWidget(self.status)
        layout.addLayout(buttons)
        self.scanner = Scanner()
        self.scanner.found.connect(self.show_models)
        self.rescan()

    def rescan(self) -> None:
        self.scanner.start(self.folders, self.roots)

    def show_models(self, models: list) -> None:
        self.models = models
        self.table.setRowCount(len(models))
        for row, m in enumerate(models):
            fits = verdict(m, self.memory, self.on_cuda) if self.memory else "unknown until the engine reports memory"
            cells = [m.name, m.source, m.architecture, count(m.parameters), f"{m.file_bytes / 2**30:.2f} GiB",
                     f"{m.trained_context:,}" if m.trained_context else "?", fits]
            for col, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setToolTip(m.path if col == 0 else text)
                self.table.setItem(row, col, item)
        self.status.setText(f"{len(models)} model(s): the Hugging Face cache, LM Studio's folder, kvchat's "
                            "models folder and the folders you added." if models else
                            "No models found. Add a folder, open a .gguf, or type a hub id in Settings.")

    def add_folder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of models")
        if folder:
            self.add(folder)

    def add(self, folder: str) -> None:
        if folder not in self.folders:
            self.folders.append(folder)
        self.rescan()

    def open_file(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self.pick(path)

    def pick(self, path: str) -> None:
        from pathlib import Path

        model = describe(Path(path), "picked")
        if model is not None:
            self.show_models(self.models + [model])
            self.table.selectRow(len(self.models) - 1)

    def load_selected(self) -> None:
        rows = self.table.selectionModel().selectedRows()
        if rows:
            self.chosen.emit(self.models[rows[0].row()].path)
            self.accept()
