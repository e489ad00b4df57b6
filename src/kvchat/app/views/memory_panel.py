"""The memory panel: where memory goes, in numbers (weights, KV in use, prefix cache, free), the KV
precision, and the largest context each precision would hold here, capped at what the model was
trained on. On a connection: the server's own KV-cache usage and prefix-cache hit rate, from its
/metrics, or "not reported"."""
from PySide6.QtCore import QEvent, Qt
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QProgressBar, QVBoxLayout, QWidget

from kvchat.core.memory import GiB

from kvchat.app.views.gauge import MemoryGauge, colours, is_dark, segments

PANEL_WIDTH = 220  # beside the list of chats and the top bar, each at its minimum, within 1,000 px
ROWS = ["weights", "KV in use", "prefix cache", "KV free", "activations", "kvchat itself", "other programs", "free"]
ROW_TIPS = {"kvchat itself": "What kvchat holds besides the weights and the KV cache: Python, Qt and torch, and on "
                             "the CPU the copy of cached conversations kept in RAM"}


def percent(value: float | None) -> str:
    return "not reported" if value is None else f"{100 * value:.1f}%"


def server_text(memory: dict | None, url: str) -> str:
    """The server's figures, named as the server's: kvchat knows nothing of its memory but these."""
    if memory is None:
        return f"<b>The server's KV cache</b><br>{url}<br><br>asking the server's /metrics…"
    who = memory.get("server")
    if who is None:
        return (f"<b>The server's KV cache</b><br>{url}<br><br>The server exposes no /metrics: its KV-cache "
                "usage and prefix-cache hit rate are not reported.")
    rows = [("server's KV-cache usage", percent(memory.get("kv_usage"))),
            ("server's prefix-cache hit rate", percent(memory.get("prefix_hit_rate")))]
    if memory.get("requests_running") is not None:
        rows.append(("requests running there", f"{memory['requests_running']:.0f}"))
    table = "".join(f"<tr><td>{k}</td><td align='right'><b>{v}</b></td></tr>" for k, v in rows)
    return f"<b>The server's KV cache</b> ({who})<br>{url}<table cellspacing='4'>{table}</table>"


def tiers_text(tiers: dict) -> str:
    """The KV tiers under the pool: where evicted and earlier conversations wait to be reused. A line
    each, not a table: in the panel's width a table's cells broke "0 MiB of 5.47 GiB" in two."""
    rows = [f"{name}: {gib(tiers[key + '_used'])} of {gib(tiers[key + '_capacity'])}, {tiers[key + '_hits']:,} hits"
            for name, key in (("RAM cache", "ram"), ("disk cache", "disk")) if tiers.get(key + "_capacity")]
    return "Saved conversations:<br>" + "<br>".join(rows) if rows else ""


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 10 else f"{n / (1 << 20):.0f} MiB"


class MemoryPanel(QFrame):
    def __init__(self):
        super().__init__()
        self.setObjectName("memoryPanel")
        self.setFixedWidth(PANEL_WIDTH)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(16, 14, 16, 14)
        title = QLabel("<b>Memory</b>")
        self.where = QLabel("waiting for the engine…")
        self.where.setProperty("muted", True)
        self.where.setWordWrap(True)
        self.gauge = MemoryGauge()
        self.gauge.setMinimumHeight(14)
        grid = QGridLayout()
        grid.setHorizontalSpacing(8)
        self.values: dict[str, QLabel] = {}
        self.keys: dict[str, QLabel] = {}
        for row, label in enumerate(ROWS):
            key = self.keys[label] = QLabel()
            value = QLabel("–")
            value.setAlignment(Qt.AlignRight)
            key.setToolTip(ROW_TIPS.get(label, ""))
            grid.addWidget(key, row, 0)
            grid.addWidget(value, row, 1)
            self.values[label] = value
        self.precision = QLabel("KV precision: –")
        self.contexts = QLabel()
        self.contexts.setWordWrap(True)
        self.contexts.setTextFormat(Qt.RichText)
        self.local = QWidget()  # this computer's memory; hidden on a connection
        local = QVBoxLayout(self.local)
        local.setContentsMargins(0, 0, 0, 0)
        for w in (self.where, self.gauge):
            local.addWidget(w)
        local.addLayout(grid)
        local.addSpacing(8)
        local.addWidget(self.precision)
        local.addWidget(self.contexts)
        self.tiers = QLabel(objectName="kvTiers", wordWrap=True, textFormat=Qt.RichText)
        local.addWidget(self.tiers)
        self.chat = QLabel(objectName="chatTokens", wordWrap=True, textFormat=Qt.RichText)
        self.chat_bar = QProgressBar(objectName="chatTokensBar", textVisible=False, maximumHeight=6)
        self.saved = QLabel(objectName="prefixSaved", wordWrap=True, textFormat=Qt.RichText)
        self.saved.setToolTip("Prompt tokens the prefix cache served today: the persona and the earlier "
                              "messages of a chat are computed once, and each new turn reuses them.")
        self.server = QLabel(objectName="serverMemory", wordWrap=True, textFormat=Qt.RichText)
        self.server.hide()
        layout.addWidget(title)
        for w in (self.chat, self.chat_bar, self.saved):
            layout.addWidget(w)
        layout.addSpacing(8)
        layout.addWidget(self.local)
        layout.addWidget(self.server)
        layout.addStretch(1)
        self.colour_keys()

    def colour_keys(self) -> None:
        shade = colours(is_dark(self))
        for label, key in self.keys.items():
            key.setText(f'<span style="color:{shade[label]}">&#9632;</span> {label}')

    def changeEvent(self, event) -> None:
        if event.type() == QEvent.PaletteChange:  # the theme changed
            self.colour_keys()
        super().changeEvent(event)

    def show_server(self, memory: dict | None, url: str) -> None:
        self.local.hide()
        self.server.setText(server_text(memory, url))
        self.server.show()

    def show_snapshot(self, snapshot: dict) -> None:
        self.server.hide()
        self.local.show()
        self.gauge.update_snapshot(snapshot)
        where = "System RAM (running on the CPU)" if snapshot["on_cpu"] else snapshot["device"]
        self.where.setText(f"{where}: {gib(snapshot['total'])}")
        for label, size, _ in segments(snapshot):
            self.values[label].setText(gib(size))
        self.precision.setText(f"KV precision: <b>{snapshot['precision']}</b>")
        self.tiers.setText(tiers_text(snapshot.get("tiers") or {}))

    def show_chat(self, tokens: int | None, context: int | None, saved: int) -> None:
        """This conversation's tokens against the context, and the prefix cache's savings today."""
        if tokens is None:
            self.chat.setText("<b>This chat</b>: no reply yet")
        elif context:
            self.chat.setText(f"<b>This chat</b>: {tokens:,} of {context:,} tokens ({100 * tokens / context:.0f}% "
                              "of the context)")
        else:
            self.chat.setText(f"<b>This chat</b>: {tokens:,} tokens")
        self.chat_bar.setVisible(bool(context) and tokens is not None)
        if context:
            self.chat_bar.setRange(0, context)
            self.chat_bar.setValue(min(tokens or 0, context))
        self.saved.setText(f"Prefix cache today: <b>{saved:,}</b> tokens reused, not computed")

    def show_contexts(self, max_context: dict[str, int], trained: int | None) -> None:
        """``max_context``: the planner's largest context per precision on this machine. When every
        precision holds the trained limit, one line says so (four equal rows told nothing)."""
        if trained is not None and all(tokens >= trained for tokens in max_context.values()):
            self.contexts.setText(f"Every KV precision holds the model's whole trained context here "
                                  f"({trained:,} tokens).")
            return
        rows = []
        for name, tokens in max_context.items():
            capped = trained is not None and tokens > trained
            shown = f"{min(tokens, trained) if capped else tokens:,}"
            rows.append(f"<tr><td>{name}</td><td align='right'>{shown}</td>"
                        f"<td>{' (trained limit)' if capped else ''}</td></tr>")
        self.contexts.setText("Largest context here:<table cellspacing='4'>" + "".join(rows) + "</table>")
