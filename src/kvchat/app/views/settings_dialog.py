"""The settings panel: model, context, KV precision, weights, headroom and sampling, with the
planner's estimate updated as the values change, capped at the context the model was trained on.
Context and precision apply without a reload. On a connection, only sampling is ours to set: the
model, context and KV precision are the server's."""
from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QCheckBox, QDialogButtonBox, QDoubleSpinBox, QFormLayout, QFrame, QLabel, QLineEdit,
                               QPushButton, QScrollArea, QSpinBox, QVBoxLayout, QWidget)

from kvchat.core.memory import GiB, plan
from kvchat.core.memory_policy import estimate_weights

from kvchat.app.models.sampling_defaults import FALLBACK
from kvchat.app.models.words import SAVING, SAVING_HELP, WEIGHTS
from kvchat.app.views.sheet import Sheet
from kvchat.app.views.value_combo import ValueCombo
from kvchat.core.config import DEFAULT_CONTEXT, DISK_CACHE_BYTES, KV_CHOICES



HELP = {  # a line under the settings whose names alone say too little
    "Context length": "How much of the conversation the model reads at once, in tokens (about ¾ of a word each).",
    "Memory saving": "Stores the model's working memory of the chat (its KV cache) in fewer bits: longer chats "
                     "fit, at a small cost in quality. Automatic saves only as much as needed.",
    "Model weights": "Fewer bits per weight: less memory and faster replies. Automatic picks what runs fastest here.",
    "Memory kept free": "Room kvchat leaves for the rest of the computer (KV: headroom).",
    "Speculation": "Text the reply repeats from the chat (code being edited, a quoted paragraph) is checked "
                   "several words at a time: the same reply, sooner. It turns itself off where it does not pay.",
}


def trained_context(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) if config is not None else None


MIN_WIDTH = 620  # pixels: the help lines wrap in two or three lines


SECTIONS = {  # a card each, as the library's model cards: what the rows have in common
    "The model and its memory": ("Model", "Context length", "Memory saving", "Model weights", "Memory kept free"),
    "Conversations kept": ("RAM cache", "Disk cache", ""),
    "Replies": ("Temperature", "Top-p", "Top-k (0: off)", "Min-p", "Repetition penalty", "Max new tokens", "Seed",
                "Speculation"),
}


class SettingsDialog(Sheet):
    clear_cache = Signal()  # "Clear cached conversations": the engine empties its RAM and disk tiers
    def __init__(self, parent, engine_settings: dict, sampling: dict, model_config=None, memory: int | None = None,
                 on_cuda: bool = False, server: str | None = None):
        super().__init__(parent, "Settings", "Context length and memory saving apply without reloading the model; "
                                             "the weights' format reloads it.")
        self.model_config, self.memory = model_config, memory
        # what auto chose for the loaded model (measured on the CPU), while auto is what it was loaded with
        self.auto_chose = getattr(model_config, "kvchat_weights", None) \
            if engine_settings.get("weights", "auto") == "auto" else None
        # the form scrolls where the screen is too short for it: squeezed into the dialog, its
        # wrapped help lines lost their first and last lines
        self.body = QWidget()
        self.model = QLineEdit(engine_settings.get("model", "starter"))
        self.model.setToolTip("'starter', a model folder, a .gguf file, or a hub id (org/name)")
        self.context = QSpinBox(minimum=256, maximum=1 << 20, singleStep=1024,
                                value=engine_settings.get("max_context", DEFAULT_CONTEXT))
        self.precision = ValueCombo({v: f"{SAVING[v]} (KV {v})" if v != "auto" else SAVING[v] for v in KV_CHOICES},
                                    SAVING_HELP)
        self.precision.setCurrentText(engine_settings.get("kv_precision", "auto"))
        self.on_cuda = on_cuda
        # auto: on the CPU the mode measured fastest here (core.memory_policy), the checkpoint's own on CUDA
        formats = ["auto", "none", "int8", "nf4"] if on_cuda else ["auto", "none", "bf16", "int8", "int4"]
        stored = "as stored" + ("" if on_cuda else " (fp32 on the CPU)")
        self.weights = ValueCombo({w: stored if w == "none" else WEIGHTS[w] for w in formats})
        self.weights.setCurrentText(engine_settings.get("weights", "auto"))
        self.weights.setToolTip("Weights in memory: fewer bytes read per token is faster decode. "
                                "none keeps the checkpoint's own" + ("" if on_cuda else " (fp32 on the CPU)"))
        self.headroom = QDoubleSpinBox(minimum=0, maximum=64, singleStep=0.25, suffix=" GiB",
                                       value=engine_settings.get("headroom_gib", 1.0))
        self.ram_cache = QDoubleSpinBox(minimum=0, maximum=1024, singleStep=0.5, suffix=" GiB", specialValueText="auto",
                                        value=engine_settings.get("ram_cache_gib", 0),
                                        toolTip="KV blocks evicted from the pool are kept in RAM up to this; auto: a "
                                                "quarter of the RAM free at start. Applies at the next start or model load")
        self.disk_cache = QDoubleSpinBox(minimum=0, maximum=4096, singleStep=1, suffix=" GiB", specialValueText="off",
                                         value=engine_settings.get("disk_cache_gib", DISK_CACHE_BYTES / GiB),
                                         toolTip="Conversations' KV saved in the cache folder up to this, so an old chat "
                                                 "resumes without recomputing. Applies at the next start or model load")
        self.clear_button = QPushButton("Clear cached conversations")
        self.clear_button.setToolTip("Delete every conversation's KV from RAM and disk now (personas stay)")
        self.clear_button.clicked.connect(self.clear_cache)
        bridge = getattr(parent, "bridge", None)
        if bridge is not None:
            self.clear_cache.connect(lambda: bridge.forget(None))
        self.temperature = QDoubleSpinBox(minimum=0, maximum=2, singleStep=0.05, value=sampling.get("temperature", FALLBACK["temperature"]))
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1, singleStep=0.05, value=sampling.get("top_p", FALLBACK["top_p"]))
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=sampling.get("top_k", 0))
        self.min_p = QDoubleSpinBox(minimum=0, maximum=0.99, singleStep=0.01, value=sampling.get("min_p", 0.0))
        self.repetition = QDoubleSpinBox(minimum=0.5, maximum=2, singleStep=0.05,
                                         value=sampling.get("repetition_penalty", FALLBACK["repetition_penalty"]))
        self.max_new = QSpinBox(minimum=1, maximum=32768, value=sampling.get("max_new_tokens", FALLBACK["max_new_tokens"]))
        self.seed = QSpinBox(minimum=-1, maximum=2 ** 31 - 1, value=sampling.get("seed") or -1, specialValueText="random")
        self.speculate = QCheckBox("Propose tokens from the conversation", checked=sampling.get("speculate", True))
        self.estimate = QLabel()
        self.estimate.setWordWrap(True)
        self.warning = QLabel()
        self.warning.setWordWrap(True)
        self.warning.setStyleSheet("color: #c2410c;")
        widgets = {"Model": self.model, "Context length": self.context, "Memory saving": self.precision,
                   "Model weights": self.weights, "Memory kept free": self.headroom, "RAM cache": self.ram_cache,
                   "Disk cache": self.disk_cache, "": self.clear_button, "Temperature": self.temperature,
                   "Top-p": self.top_p, "Top-k (0: off)": self.top_k, "Min-p": self.min_p,
                   "Repetition penalty": self.repetition, "Max new tokens": self.max_new, "Seed": self.seed,
                   "Speculation": self.speculate}
        column = QVBoxLayout(self.body)
        column.setContentsMargins(0, 0, 0, 0)
        column.setSpacing(10)
        for section, labels in SECTIONS.items():
            card = QFrame(objectName="sheetCard")
            form = QFormLayout(card)
            form.setContentsMargins(14, 12, 14, 12)
            form.addRow(QLabel(section, objectName="sheetSection"))
            for label in labels:
                form.addRow(label, widgets[label])
                if label in HELP:
                    help_line = QLabel(HELP[label], wordWrap=True, objectName="help")
                    help_line.setProperty("help", True)  # the style sheet's small muted text
                    form.addRow("", help_line)
            column.addWidget(card)
            if section == "The model and its memory":  # the estimate follows the rows it is made from
                form.addRow("Estimate", self.estimate)
                form.addRow("", self.warning)
        self.button("Cancel", QDialogButtonBox.RejectRole, "plain")
        self.save_button = self.button("Save", QDialogButtonBox.AcceptRole, "accent")
        self.save_button.setDefault(True)
        scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.NoFrame)
        scroll.setWidget(self.body)
        self.content.addWidget(scroll)
        self.setMinimumWidth(MIN_WIDTH)
        for w in (self.context, self.headroom):
            w.valueChanged.connect(self.update_estimate)
        self.weights.currentTextChanged.connect(self.update_estimate)
        self.update_estimate()
        if server:
            self.on_server(server)

    def showEvent(self, event) -> None:
        """As tall as the form wants, up to what the screen has room for; past that it scrolls."""
        screen = self.screen().availableGeometry().height() if self.screen() else 800
        width = max(self.width(), MIN_WIDTH)
        margins = self.outer.contentsMargins()
        inner = width - margins.left() - margins.right()
        want = self.body.heightForWidth(inner) if self.body.hasHeightForWidth() else self.body.sizeHint().height()
        chrome = (self.heading.sizeHint().height() + self.subtitle.heightForWidth(inner)
                  + self.buttons.sizeHint().height() + margins.top() + margins.bottom() + 3 * self.outer.spacing())
        self.resize(width, min(want + chrome + 4, int(screen * 0.9)))
        super().showEvent(event)

    def on_server(self, server: str) -> None:
        for w in (self.model, self.context, self.precision, self.weights, self.headroom, self.ram_cache,
                  self.disk_cache, self.clear_button):
            w.setEnabled(False)
            w.setToolTip(f"set by the server at {server}")
        self.warning.hide()
        self.estimate.setText(f"Running on {server}: its model, context and KV cache are its own. "
                              "Sampling below applies to its replies.")

    def focus_on(self, setting: str) -> None:
        """A top-bar chip opens the dialog at its own setting."""
        widget = {"model": self.model, "context": self.context, "precision": self.precision}.get(setting)
        if widget is not None:
            widget.setFocus()

    def update_estimate(self) -> None:
        trained = trained_context(self.model_config)
        over = trained is not None and self.context.value() > trained
        self.warning.setText(f"{self.context.value():,} tokens is more than the {trained:,} this model was trained "
                             "on: replies past that length are likely to go wrong." if over else "")
        self.warning.setVisible(over)
        if self.model_config is None or not self.memory:
            self.estimate.setText("(the estimate appears once the model is loaded)")
            return
        weights = estimate_weights(self.weights.currentText(), self.on_cuda, self.auto_chose)
        p = plan(self.model_config, self.memory, self.context.value(), weights, int(self.headroom.value() * GiB))
        holds = ", ".join(f"{name} {min(tokens, trained or tokens):,}" for name, tokens in p.max_context.items())
        holds += " tokens"
        if trained is not None and all(tokens >= trained for tokens in p.max_context.values()):
            holds = f"{trained:,} tokens in every precision"  # five equal figures: one line, not three
        if trained is not None and any(tokens > trained for tokens in p.max_context.values()):
            holds += f" (capped at the trained {trained:,})"
        self.estimate.setText(f"largest context: {holds}. Auto would pick: {p.auto or 'nothing fits'}")

    def engine_settings(self) -> dict:
        return {"model": self.model.text().strip() or "starter", "max_context": self.context.value(),
                "kv_precision": self.precision.currentText(), "weights": self.weights.currentText(),
                "headroom_gib": self.headroom.value(), "ram_cache_gib": self.ram_cache.value(),
                "disk_cache_gib": self.disk_cache.value()}

    def sampling(self) -> dict:
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(), "top_k": self.top_k.value(),
                "min_p": self.min_p.value(), "repetition_penalty": self.repetition.value(),
                "max_new_tokens": self.max_new.value(), "seed": None if self.seed.value() < 0 else self.seed.value(),
                "speculate": self.speculate.isChecked()}
