"""The model library: the models already on disk, what each is, and whether it fits here (the
planner's verdict) before anything loads; one click loads one. Scanning reads only configs and GGUF
headers, on a worker thread; a hub id downloads on another, with progress and cancel, and joins the
list when it is there."""
import threading

from PySide6.QtCore import QEvent, QObject, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QDialog, QFileDialog, QHBoxLayout, QHeaderView, QLabel,
                               QLineEdit, QProgressBar, QPushButton, QTableWidget, QTableWidgetItem, QVBoxLayout)

from kvchat.core.model_library import describe, fetch, hub_id_problem, scan, verdict

COLUMNS = ["Model", "Source", "Architecture", "Parameters", "Size", "Trained context", "On this machine"]


def count(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


class Scanner(QObject):
    found = Signal(list)

    def start(self, folders: list[str], roots=None) -> None:
        threading.Thread(target=lambda: self.found.emit(scan(folders, roots)), daemon=True).start()


class Downloader(QObject):
    """One hub download at a time, on a worker thread; its signals arrive queued on the GUI thread."""
    progress = Signal(object, object)  # bytes done, total (0: unknown); object: sizes pass 2 GiB
    downloaded = Signal(object)  # the LocalModel
    failed = Signal(str)

    def __init__(self):
        super().__init__()
        self.cancelled = threading.Event()

    def start(self, repo_id: str) -> None:
        self.cancelled = cancelled = threading.Event()  # a new one each time: an old download keeps its own
        threading.Thread(target=self._run, args=(repo_id, cancelled), name="kvchat-download", daemon=True).start()

    def cancel(self) -> None:
        self.cancelled.set()

    def _run(self, repo_id: str, cancelled: threading.Event) -> None:
        try:
            model = fetch(repo_id, self.progress.emit, cancelled)
        except Exception as e:  # ModelError: one line already; anything else, its first line
            self.failed.emit((str(e).strip().splitlines() or [type(e).__name__])[0])
            return
        self.downloaded.emit(model)


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
        layout.addLayout(self._download_row())
        layout.addWidget(self.status)
        layout.addLayout(buttons)
        self.scanner = Scanner()
        self.scanner.found.connect(self.show_models)
        self.rescan()

    def _download_row(self) -> QHBoxLayout:
        self.hub_id = QLineEdit(placeholderText="Download from Hugging Face: org/name")
        self.hub_id.installEventFilter(self)  # Return downloads; it must not reach the dialog's Load button
        self.download_button = QPushButton("Download")
        self.download_button.setAutoDefault(False)
        self.download_bar = QProgressBar(minimumWidth=260, textVisible=True)
        self.cancel_download_button = QPushButton("Cancel download")
        self.cancel_download_button.setAutoDefault(False)
        self.downloading: str | None = None
        self.downloader = Downloader()
        self.downloader.progress.connect(self.on_download_progress)
        self.downloader.downloaded.connect(self.on_downloaded)
        self.downloader.failed.connect(self.on_download_failed)
        self.download_button.clicked.connect(self.download)
        self.cancel_download_button.clicked.connect(self.cancel_download)
        row = QHBoxLayout()
        row.addWidget(self.hub_id, 1)
        for w in (self.download_button, self.download_bar, self.cancel_download_button):
            row.addWidget(w)
        self.show_downloading(False)
        return row

    def eventFilter(self, obj, event) -> bool:
        if obj is self.hub_id and event.type() == QEvent.KeyPress and event.key() in (Qt.Key_Return, Qt.Key_Enter):
            self.download()
            return True
        return super().eventFilter(obj, event)

    # -- downloading a hub id --

    def download(self) -> None:
        if self.downloading:
            return
        problem = hub_id_problem(self.hub_id.text())
        if problem:
            self.status.setText(problem)
            return
        self.downloading = self.hub_id.text().strip()
        self.show_downloading(True)
        self.download_bar.setRange(0, 0)  # busy until the hub says how large it is
        self.download_bar.setFormat(f"{self.downloading}: starting")
        self.status.setText(f"Downloading {self.downloading} into the Hugging Face cache…")
        self.downloader.start(self.downloading)

    def show_downloading(self, downloading: bool) -> None:
        self.download_bar.setVisible(downloading)
        self.cancel_download_button.setVisible(downloading)
        self.download_button.setEnabled(not downloading)
        self.hub_id.setEnabled(not downloading)

    def on_download_progress(self, done: int, total: int) -> None:
        if total > 0 and self.downloading:
            self.download_bar.setRange(0, 1000)
            self.download_bar.setValue(int(1000 * done / total))
            self.download_bar.setFormat(f"{self.downloading}: {done / 1e9:.2f} / {total / 1e9:.2f} GB")

    def cancel_download(self) -> None:
        if self.downloading:
            self.downloader.cancel()
            self.download_bar.setFormat(f"{self.downloading}: cancelling…")

    def on_downloaded(self, model) -> None:
        name, self.downloading = self.downloading, None
        self.show_downloading(False)
        self.show_models([m for m in self.models if m.path != model.path] + [model])
        self.table.selectRow(len(self.models) - 1)
        self.status.setText(f"{name} is downloaded: Load uses it.")

    def on_download_failed(self, message: str) -> None:
        self.downloading = None
        self.show_downloading(False)
        self.status.setText(message)

    def done(self, result: int) -> None:
        """Closing the dialog stops a download under way."""
        self.downloader.cancel()
        super().done(result)

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
                            "No models found. Add a folder, open a .gguf, or download a hub id above.")

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
