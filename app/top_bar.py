"""Chips in the top bar for the model (name, size, weights), the context and the KV precision;
each opens the setting it names."""
from PySide6.QtCore import Signal
from PySide6.QtWidgets import QToolButton

from kvchat.engine.memory import parameter_counts


def size_label(config) -> str:
    try:
        n = sum(parameter_counts(config))
    except Exception:  # a config the planner cannot read still gets a chip, without a size
        return ""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def model_name(source_label: str) -> str:
    if source_label.startswith("starter"):
        return "SmolLM2-135M-Instruct"
    return source_label.rstrip("/").split("/")[-1].removesuffix(".gguf")


class Chip(QToolButton):
    opened = Signal(str)  # the setting to open

    def __init__(self, setting: str, tip: str):
        super().__init__()
        self.setting = setting
        self.setProperty("chip", True)
        self.setToolTip(tip)
        self.setAutoRaise(True)
        self.clicked.connect(lambda: self.opened.emit(self.setting))
