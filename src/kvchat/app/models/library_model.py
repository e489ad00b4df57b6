"""The model library's rows for its QML view: each model on this machine with what it is and the
planner's badge, the loaded one first."""
from pathlib import Path

from PySide6.QtCore import Qt

from kvchat.app.models.row_model import RowModel, role_ids
from kvchat.core.model_library import LocalModel, fit

ROLES = ["name", "details", "source", "path", "kind", "badge", "tip", "loaded"]
ROLE_IDS = role_ids(ROLES)
UNKNOWN_MEMORY = "unknown until the engine reports memory"


def count(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def details(m: LocalModel) -> str:
    """Architecture, parameters, quantization, file size, trained context: one line."""
    trained = f"{m.trained_context:,}-token context" if m.trained_context else "context ?"
    return " · ".join([m.architecture, f"{count(m.parameters)} parameters", m.quantization, size(m.file_bytes), trained])


def same(path: str, other: str) -> bool:
    try:
        return Path(path).resolve() == Path(other).resolve()
    except OSError:
        return path == other


class LibraryModel(RowModel):
    ROLE_IDS = ROLE_IDS

    def __init__(self, parent=None):
        super().__init__(parent)
        self.models: list[LocalModel] = []

    def data(self, index, role=Qt.DisplayRole):
        if not index.isValid():
            return None
        row = self.rows[index.row()]
        if role == Qt.DisplayRole:
            return row["name"]
        name = next((n for n, rid in ROLE_IDS.items() if rid == role), None)
        return row.get(name) if name else None

    def show(self, models: list[LocalModel], loaded: list[str], memory: int | None, on_cuda: bool) -> None:
        """``loaded``: the loaded model's path and setting; it goes first, marked."""
        def is_loaded(m: LocalModel) -> bool:
            return any(m.name == key or same(m.path, key) for key in loaded if key)

        self.beginResetModel()
        self.models = sorted(models, key=lambda m: not is_loaded(m))  # stable: the scan's order after it
        self.rows = []
        for m in self.models:
            verdict = fit(m, memory, on_cuda) if memory else None
            self.rows.append({
                "name": m.name, "details": details(m), "source": m.source, "path": m.path,
                "kind": verdict.kind if verdict else "unknown", "badge": verdict.label if verdict else UNKNOWN_MEMORY,
                "tip": verdict.tooltip(m.trained_context) if verdict else UNKNOWN_MEMORY, "loaded": is_loaded(m)})
        self.endResetModel()
