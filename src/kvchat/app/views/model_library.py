"""The model library: the models on this machine, the loaded one first, each with what it is and
whether it fits here (the planner's badge, its contexts in the tooltip) before anything loads; a
click on Load loads one, with the window's staged load bar. Drawn in QML (qml/LibraryView.qml) in
the chat column's look. Scanning reads only configs and GGUF headers, on a worker thread; a hub id
downloads on another, with progress and cancel, and joins the list when it is there."""
import threading
from pathlib import Path

from PySide6.QtCore import Property, QMetaObject, QObject, Qt, QUrl, Signal, Slot
from PySide6.QtQuickWidgets import QQuickWidget
from PySide6.QtWidgets import QDialog, QFileDialog, QVBoxLayout

from kvchat.core.model_library import describe, fetch, hub_id_problem, scan
from kvchat.core.model_source import ModelError, starter_path

from kvchat.app.models.library_model import LibraryModel
from kvchat.app.package_data import QML_DIR
from kvchat.app.views.chat_view import prepare_quick
from kvchat.app.views.theme import Theme


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


def installed_starter() -> list:
    """The starter as the library lists it: it lives inside a Python package, where no scan looks."""
    try:
        model = describe(starter_path(), "kvchat's starter")
    except ModelError:
        return []
    return [model] if model is not None else []


class LibraryFace(QObject):
    """What the QML reads and calls, for the dialog. A child of the QML view, so it outlives the
    view's QML: with the dialog itself in that place, every binding warned as the dialog went."""
    changed = Signal()

    def __init__(self, dialog, view):
        super().__init__(view)
        self.dialog = dialog
        dialog.changed.connect(self.changed)

    status = Property(str, lambda self: self.dialog.status, notify=changed)
    progress = Property(float, lambda self: self.dialog.progress, notify=changed)  # -1: busy
    progressText = Property(str, lambda self: self.dialog.progressText, notify=changed)
    isDownloading = Property(bool, lambda self: self.dialog.isDownloading, notify=changed)

    @Slot(str)
    def load(self, path: str) -> None:
        # queued: the dialog closes and the model loads after the QML click's handler has returned
        self.dialog.pending = path
        QMetaObject.invokeMethod(self.dialog, "load_pending", Qt.QueuedConnection)

    @Slot(str)
    def download(self, text: str) -> None:
        self.dialog.download(text)

    @Slot()
    def cancelDownload(self) -> None:
        self.dialog.cancelDownload()

    @Slot()
    def addFolder(self) -> None:
        self.dialog.addFolder()

    @Slot()
    def openFile(self) -> None:
        self.dialog.openFile()

    @Slot()
    def close(self) -> None:
        self.dialog.reject()


class ModelLibrary(QDialog):
    """``chosen`` carries the path to load. The QML view calls its face's slots and reads its properties."""
    chosen = Signal(str)
    changed = Signal()

    def __init__(self, parent, folders: list[str], memory: int | None, on_cuda: bool, roots=None,
                 theme=None, loaded: list[str] = ()):
        super().__init__(parent)
        self.setWindowTitle("Models on this computer")
        self.resize(860, 600)
        self.folders, self.memory, self.on_cuda, self.roots = list(folders), memory, on_cuda, roots
        self.loaded = list(loaded)
        self.pending = ""  # the model a click asked for, loaded once the click's handler has returned
        self.models = []
        self.list_model = LibraryModel(self)
        self._status, self._progress, self._progress_text = "Looking for models…", -1.0, ""
        self.downloading: str | None = None
        self.downloader = Downloader()
        self.downloader.progress.connect(self.on_download_progress)
        self.downloader.downloaded.connect(self.on_downloaded)
        self.downloader.failed.connect(self.on_download_failed)
        prepare_quick()
        self.view = QQuickWidget(self)
        self.theme = theme
        if theme is None:  # a child of the view, as the face below
            self.theme = Theme()
            self.theme.setParent(self.view)
        self.face = LibraryFace(self, self.view)
        self.view.setResizeMode(QQuickWidget.SizeRootObjectToView)
        ctx = self.view.rootContext()
        for name, value in (("library", self.face), ("libraryModel", self.list_model), ("theme", self.theme)):
            ctx.setContextProperty(name, value)
        self.view.setSource(QUrl.fromLocalFile(str(QML_DIR / "LibraryView.qml")))
        if self.view.status() == QQuickWidget.Error:
            raise RuntimeError("the library's QML failed: " + "; ".join(e.toString() for e in self.view.errors()))
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.view)
        self.scanner = Scanner()
        self.scanner.found.connect(self.show_models)
        self.rescan()

    # -- what the view shows --

    @property
    def status(self) -> str:
        return self._status

    @property
    def progress(self) -> float:
        return self._progress  # -1: busy

    @property
    def progressText(self) -> str:
        return self._progress_text

    @property
    def isDownloading(self) -> bool:
        return self.downloading is not None

    def say(self, status: str) -> None:
        self._status = status
        self.changed.emit()

    def item(self, name: str):
        """A QML item by its objectName, depth first (the tests click them)."""
        stack = [self.view.rootObject()]
        while stack:
            item = stack.pop()
            if item.objectName() == name:
                return item
            stack.extend(reversed(item.childItems()))
        return None

    def items(self, name: str) -> list:
        found, stack = [], [self.view.rootObject()]
        while stack:
            item = stack.pop()
            if item.objectName() == name and item.isVisible():
                found.append(item)
            stack.extend(reversed(item.childItems()))
        return found

    # -- downloading a hub id --

    def download(self, text: str) -> None:
        if self.downloading:
            return
        problem = hub_id_problem(text)
        if problem:
            self.say(problem)
            return
        self.downloading = text.strip()
        self._progress, self._progress_text = -1.0, f"{self.downloading}: starting"
        self.say(f"Downloading {self.downloading} into the Hugging Face cache…")
        self.downloader.start(self.downloading)

    def on_download_progress(self, done: int, total: int) -> None:
        if total > 0 and self.downloading:
            self._progress = done / total
            self._progress_text = f"{self.downloading}: {done / 1e9:.2f} / {total / 1e9:.2f} GB"
            self.changed.emit()

    def cancelDownload(self) -> None:
        if self.downloading:
            self.downloader.cancel()
            self._progress_text = f"{self.downloading}: cancelling…"
            self.changed.emit()

    def on_downloaded(self, model) -> None:
        name, self.downloading = self.downloading, None
        self.show_models([m for m in self.models if m.path != model.path] + [model])
        self.say(f"{name} is downloaded: Load uses it.")

    def on_download_failed(self, message: str) -> None:
        self.downloading = None
        self.say(message)

    def done(self, result: int) -> None:
        """Closing the dialog stops a download under way. (Its QML is not cleared first: items a
        caller still held then ended the process in a refcount error at exit, PySide 6.12.)"""
        self.downloader.cancel()
        super().done(result)

    # -- the list --

    def rescan(self) -> None:
        self.scanner.start(self.folders, self.roots)

    def show_models(self, models: list) -> None:
        """The scan's models, with the loaded one and the starter, which no scanned folder holds."""
        extra = installed_starter()
        for key in self.loaded:
            if key and Path(key).exists() and (model := describe(Path(key), "loaded")) is not None:
                extra.append(model)
        seen, merged = set(), []
        for m in extra + list(models):
            key = Path(m.path).resolve()
            if key not in seen:
                seen.add(key)
                merged.append(m)
        self.list_model.show(merged, self.loaded, self.memory, self.on_cuda)
        self.models = self.list_model.models
        self.say(f"{len(merged)} model(s) on this computer: kvchat's starter, the Hugging Face cache, LM Studio's "
                 "folder, kvchat's models folder and the folders you added." if merged else
                 "No models found. Add a folder, open a .gguf, or download a hub id above.")

    def addFolder(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Add a folder of models")
        if folder:
            self.add(folder)

    def add(self, folder: str) -> None:
        if folder not in self.folders:
            self.folders.append(folder)
        self.rescan()

    def openFile(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", "", "GGUF models (*.gguf)")
        if path:
            self.pick(path)

    def pick(self, path: str) -> None:
        model = describe(Path(path), "picked")
        if model is not None:
            self.show_models(self.models + [model])

    @Slot()
    def load_pending(self) -> None:
        self.load(self.pending)

    def load(self, path: str) -> None:
        self.chosen.emit(path)
        self.accept()
