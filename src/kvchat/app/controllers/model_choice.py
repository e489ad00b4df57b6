"""Which model answers, and how: the settings panel, the model library, loading and switching models,
connections to servers, and what the top bar and status bar say about them. Everything it knows of
the engine comes from the bridge's state, which the engine's events set."""
from PySide6.QtCore import QObject, Qt
from PySide6.QtGui import QKeySequence, QShortcut

from kvchat.core.config import SamplingParams
from kvchat.core.connections import refused_key, remember_key
from kvchat.core.memory import GiB, plan
from kvchat.core.model_source import ModelError, source_problem, starter_path

from kvchat.app.controllers.engine_bridge import settings_in_force
from kvchat.app.models.sampling_defaults import model_defaults
from kvchat.app.models.words import saving, saving_tip, weights_label
from kvchat.app.views.key_prompt import ask_key
from kvchat.app.views.load_bar import show_loading
from kvchat.app.views.model_library import ModelLibrary
from kvchat.app.views.settings_dialog import SettingsDialog, trained_context
from kvchat.app.views.sheet import confirm
from kvchat.app.views.top_bar import model_name, size_label

# a GGUF's first conversion before its tensors count (the starter: ~2.5 s, ~1.3 s, ~1.9 s)
LIVE = ("max_context", "kv_precision", "headroom_gib")  # applied without reloading the model
LIVE_NAMES = {"max_context": "context length", "kv_precision": "memory saving", "headroom_gib": "memory headroom"}
PENDING = "Applies after this reply: "  # the notice while a live setting waits for the engine


def loaded_model(models: "ModelController") -> list[str]:
    """The loaded model as the library can find it: its setting and, for the starter, its file."""
    if not models.bridge.capabilities.models or models.config is None:
        return []
    model = models.engine_settings().get("model", "starter")
    if model == "starter":
        try:
            return [model, str(starter_path())]
        except ModelError:
            return [model]
    return [model]


def show_saving(win, setting: str, in_force: str | None) -> None:
    """The KV chip in plain words ("Memory saving: automatic"), the KV precision in its tooltip."""
    win.kv_chip.setText(f"Memory saving: {saving(setting)}", f"Saving: {saving(setting)}")
    win.kv_chip.setToolTip(saving_tip(setting, in_force))


def stop_question(count: int, change: str) -> tuple[str, str, str]:
    """The words of asking whether ``change`` may stop ``count`` replies: title, question, and the
    notice when the user says no."""
    if count == 1:
        return ("Stop the reply?", f"A reply is being written. {change} stops it where it is (what it wrote so far "
                "is kept).", "model not changed: the reply goes on")
    return ("Stop the replies?", f"{count} replies are being written. {change} stops them where they are (what "
            "they wrote so far is kept).", "model not changed: the replies go on")


class ModelController(QObject):
    """A child of the window: the bridge's signals stop reaching it when the window goes."""

    def __init__(self, win):
        super().__init__(win)
        self.win, self.store, self.bridge = win, win.store, win.bridge
        self.previous: dict | None = None  # the settings to go back to if a new model fails
        self.pending: dict | None = None  # saved once they load: a failed model is never saved
        self.config = None  # the loaded model's config and name, as its ModelReady gave them
        self.label = ""
        self.library_dialog: ModelLibrary | None = None
        QShortcut(QKeySequence("Ctrl+L"), win, self.show_library)

    def engine_settings(self) -> dict:
        return settings_in_force(self.store.setting("engine") or {}, self.bridge.settings)

    def memory(self) -> int | None:
        snap = self.win.gauge.snapshot
        return snap["total"] - snap["other_processes"] if snap else None

    def on_cuda(self) -> bool:
        snap = self.win.gauge.snapshot
        return bool(snap and not snap["on_cpu"])

    # -- settings --

    def settings_dialog(self) -> SettingsDialog:
        ours = self.bridge.capabilities.memory
        current = self.engine_settings() if ours else self.store.setting("engine") or {}
        return SettingsDialog(self.win, current, vars(self.win.sampling), self.config, self.memory(),
                              on_cuda=self.on_cuda(), server=self.bridge.server)

    def open_settings(self, focus: str | None = None) -> None:
        dialog = self.settings_dialog()
        if focus:
            dialog.focus_on(focus)
        if dialog.exec():
            self.apply_settings(dialog)

    def apply_settings(self, dialog: SettingsDialog) -> None:
        """Sampling applies to the next reply; context, precision and headroom without reloading the
        model; a different model or weight format loads at once."""
        try:
            self.win.sampling = SamplingParams(**dialog.sampling())
        except ValueError as e:
            self.win.show_error(str(e))
            return
        self.store.set_setting("sampling", dialog.sampling())
        self.win.sampling_from_model = False
        if not self.bridge.capabilities.memory and self.bridge.server is not None:
            return  # the server's model, context and precision are its own (a failed connection's are ours)
        wanted, now = dialog.engine_settings(), self.engine_settings()
        failed = self.bridge.load_error is not None
        if (wanted["model"], wanted["weights"]) != (now["model"], now["weights"]) or failed:
            # saved by on_ready; after a failed start there is no working model to go back to
            if self.reply_may_stop(f"Loading {wanted['model']} with {wanted['weights']} weights"):
                self.load_model(wanted, previous=None if failed else now)
            return
        self.store.set_setting("engine", wanted)
        changed = [k for k in LIVE if wanted[k] != now[k]]
        if changed:
            if self.bridge.busy:  # the engine rebuilds its pool only when no reply runs
                self.win.notify(PENDING + ", ".join(LIVE_NAMES[k] for k in changed))
            self.bridge.reconfigure(*(wanted[k] for k in LIVE))

    # -- loading a model --

    def library(self, roots=None) -> ModelLibrary:
        library = ModelLibrary(self.win, self.store.setting("model_folders") or [], self.memory(), self.on_cuda(), roots,
                               self.win.theme, loaded_model(self))
        library.chosen.connect(self.load_from_library)
        library.finished.connect(lambda _: self.store.set_setting("model_folders", library.folders))
        return library

    def show_library(self) -> ModelLibrary:
        """Window-modal without a nested event loop: the chat goes on streaming behind it."""
        self.library_dialog = library = self.library()
        library.setAttribute(Qt.WA_DeleteOnClose)
        library.open()
        return library

    def load_from_library(self, path: str) -> None:
        """Like choosing the model in Settings: saved only once it has loaded. On a connection, the
        app comes back to this computer with that model."""
        if not self.reply_may_stop(f"Loading {path}"):
            return
        if not self.bridge.capabilities.models:  # back on this computer, with this model
            self.use_connection(None, {**(self.store.setting("engine") or {}), "model": path})
            return
        now = self.engine_settings()
        self.load_model({**now, "model": path}, previous=None if self.bridge.load_error else now)

    def reply_may_stop(self, change: str) -> bool:
        """A model change stops the replies being written: asked first, never cut unasked."""
        count = len(self.win.replies.live)
        if not count:
            return True
        title, question, declined = stop_question(count, change)
        if confirm(self.win, title, question, "Stop and change"):
            return True
        self.win.notify(declined)
        return False

    def load_model(self, settings: dict, previous: dict | None) -> None:
        """Load ``settings`` in the engine; the chat waits, the window does not. A model that is not
        there fails here, before anything is unloaded (a switch drops the old model first)."""
        why = source_problem(settings.get("model", "starter"))
        if why:
            self.win.show_error(f"The model could not be loaded: {why}. The current model stays.")
            return
        self.win.replies.stop_all()
        self.previous, self.pending = previous, settings
        self.set_loading(True)
        self.win.notify(f"loading {settings.get('model', 'starter')}...")
        self.bridge.switch_model(settings)

    def use_connection(self, name: str | None, local_settings: dict | None = None) -> None:
        """Run on the saved connection ``name``, or on this computer (None) with ``local_settings``
        (default: the saved ones). A streaming reply stops and keeps what it had."""
        self.store.set_setting("connection", name)
        self.win.connection_box.fill(name)
        self.previous = self.pending = None
        self.config = None
        self.set_loading(True, f"connecting to {name}" if name else "loading model")
        self.win.notify(f"connecting to {name}..." if name else "back on this computer: loading the model...")
        if name:
            self.bridge.use_connection(name)
        else:
            self.pending = local_settings
            self.bridge.use_local(local_settings or self.store.setting("engine") or {})

    def set_loading(self, loading: bool, what: str = "loading model") -> None:
        show_loading(self.win, loading, what)

    def on_ready(self) -> None:
        win, bridge = self.win, self.bridge
        self.set_loading(False)
        if self.pending is not None:  # it loaded: now it is the setting
            self.store.set_setting("engine", self.pending)
        self.previous = self.pending = None
        self.config, self.label = bridge.model_config, bridge.label
        if win.sampling_from_model:  # the model's own sampling defaults; a server's model has none here
            win.sampling = SamplingParams(**model_defaults(bridge.model_generation))
        server = bridge.server
        win.precision_label.setText(f"on {bridge.settings['host']}" if server else f"KV {bridge.precision}")
        if server:
            win.memory_panel.show_server(None, server)
        win.chat_view.actions.set_where(f"Replies come from {bridge.settings['host']}: what you type is sent "
                                        "there." if server else win.chat_view.actions.LOCAL_NOTE)
        self.update_chips()
        win.personas.update_badge()
        win.notify(f"connected: {bridge.settings['model']} at {server}" if server else
                   f"model ready: {(self.store.setting('engine') or {}).get('model', 'starter')}")
        win.replies.answer_waiting()

    def update_chips(self) -> None:
        win, bridge = self.win, self.bridge
        win.top_bar.allow(win.context_chip, bridge.capabilities.memory)
        if bridge.server is not None:  # the model and its cache are the server's: the chip names them
            win.model_chip.setText(model_name(bridge.settings["model"]))
            win.model_chip.setToolTip(f"{bridge.settings['model']} at {bridge.server}, the connection's model")
            win.kv_chip.setText("KV on the server")
            return
        win.model_chip.setToolTip("The model: click to change it")
        if self.config is None:
            return
        now = self.engine_settings()
        name, size = model_name(self.label), size_label(self.config)
        # the engine's own setting: the saved one may be newer than the model it loaded
        weights = weights_label(self.bridge.settings.get("weights", now["weights"]), getattr(self.config, "kvchat_weights", None))
        short = name.removesuffix("-Instruct").removesuffix("-Chat")  # narrow: the name that tells models apart
        win.model_chip.setText(" · ".join(p for p in (name, size, weights) if p), short)
        why = getattr(self.config, "kvchat_weights_why", None)  # auto's measurement, where it ran
        win.model_chip.setToolTip(f"{name}{f', {size} parameters' if size else ''}, {weights}"
                                  f"{f' ({why})' if why else ''}: click to change the model")
        win.context_chip.setText(f"Context: {now['max_context']:,} tokens", f"{now['max_context']:,} tokens")
        show_saving(win, now["kv_precision"], self.bridge.precision)


    def on_load_failed(self, message: str) -> None:
        """Say why; after a failed switch, load the model that worked again (its setting was never
        replaced). With none to go back to (the saved model fails at launch), say so and stay there."""
        win = self.win
        self.set_loading(False)
        previous, self.previous, self.pending = self.previous, None, None
        if previous is not None and self.bridge.load_error is None:
            # the engine brought the previous model back itself: it is the setting again
            win.show_error(f"The model could not be loaded: {message}")
            self.store.set_setting("engine", previous)
            self.update_chips()
            win.personas.update_badge()
            win.notify(f"model ready: {previous.get('model', 'starter')} (back after the failed load)")
            win.replies.answer_waiting()
        elif previous is not None:
            win.show_error(f"The model could not be loaded: {message}")
            self.load_model(previous, previous=None)
        elif refused_key(message) and (key := ask_key(win, connection := self.store.setting("connection"))):
            remember_key(connection, key)  # a session-only key is gone after a restart
            self.use_connection(connection)
        elif self.store.setting("connection"):
            win.precision_label.setText("not connected")
            win.model_chip.setText("not connected")
            win.show_error(f"Could not use the connection {self.store.setting('connection')}: {message}. "
                           "Edit it, or choose another one or this computer in the box at the top.")
        else:
            win.precision_label.setText("no model loaded")
            win.model_chip.setText("no model")
            win.show_error(f"The model could not be loaded: {message}. Choose another one in Settings.")

    def on_snapshot(self, snapshot: dict) -> None:
        win = self.win
        win.memory_panel.show_snapshot(snapshot)
        where = " · on the CPU" if snapshot["on_cpu"] else ""
        win.precision_label.setText(f"KV {snapshot['precision']}{where}")
        win.precision_label.setToolTip(f"Memory saving: {saving(snapshot['precision'])} (the KV cache's precision "
                                       f"is {snapshot['precision']})")
        if self.bridge.capabilities.memory:
            show_saving(win, self.engine_settings()["kv_precision"], snapshot["precision"])
        if self.config is not None:  # set with the engine's settings (ModelReady), headroom included
            p = plan(self.config, snapshot["total"] - snapshot["other_processes"], 4096,
                     weights_size=snapshot["weights"], headroom=self.bridge.settings.get("headroom_bytes", GiB),
                     kv_full_bytes=4 if snapshot["on_cpu"] else 2)
            win.memory_panel.show_contexts(p.max_context, trained_context(self.config))

    def on_server_memory(self, memory: dict) -> None:
        if self.bridge.server is not None:
            self.win.memory_panel.show_server(memory, self.bridge.server)
