"""The model library (issues 10 and 29): the models on this machine, the loaded one first, each with
what it is and the planner's badge for this machine, in a QML view; its Load button loads one, with
the window's staged load bar, and it is saved only once it has loaded. The fake backend (tests/support)
loads them, but for the hub model, loaded end to end by a real engine."""
import json

import pytest

from PySide6.QtCore import QPoint, QPointF, Qt
from PySide6.QtGui import QColor
from PySide6.QtWidgets import QApplication

from kvchat.app.views.theme import COLOURS
from kvchat.core.model_source import starter_path

from qt_helpers import shown

HUGE = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
        "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072}  # a 405B shape: no machine here holds it


def click(qtbot, library, item):
    """A click on a QML item of the library, as the pointer gives it."""
    point = item.mapToScene(QPointF(item.width() / 2, item.height() / 2)).toPoint()
    qtbot.mouseClick(library.view, Qt.LeftButton, pos=point)


def cards(library, key="modelName") -> dict:
    """Each card's name (or ``key``): its details line, its badge, its tooltip, and its Load button."""
    out = {}
    for card in library.items("modelCard"):
        inner = {}
        stack = list(card.childItems())
        while stack:
            item = stack.pop()
            inner.setdefault(item.objectName(), item)
            stack.extend(item.childItems())
        out[card.property(key)] = (inner["modelDetails"].property("text"), inner["fitBadge"].property("label"),
                                           inner["fitBadge"].property("tip"), inner["loadModel"])
    return out


def open_library(qtbot, win, monkeypatch, roots):
    monkeypatch.setattr("kvchat.core.model_library.default_roots", lambda: roots)
    qtbot.mouseClick(win.library_button, Qt.LeftButton)
    library = win.models.library_dialog
    qtbot.waitUntil(lambda: library.isVisible() and not library.status.startswith("Looking"), timeout=30000)
    return library


def test_the_library_shows_the_loaded_starter_first_with_its_verdict(qtbot, app_parts, tmp_path, monkeypatch):
    """Issue 29: it said "No models found" while the starter was loaded."""
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=15000)
    library = open_library(qtbot, win, monkeypatch, [(tmp_path / "empty", "hub cache")])
    names = [c.property("modelName") for c in library.items("modelCard")]
    assert len(names) == 1 and "No models found" not in library.status
    details, badge, tip, load = cards(library)[names[0]]
    assert details == "llama · 135M parameters · Q4_1 · 94 MiB · 8,192-token context"
    assert badge == "fits · 8k"
    assert "KV fp16: 8,192 tokens (the model's trained limit)" in tip and "KV int4:" in tip
    assert library.items("loadedTag") and load.property("text") == "Loaded" and not load.property("enabled")
    click(qtbot, library, library.item("closeLibrary"))
    qtbot.waitUntil(lambda: not library.isVisible())


def test_the_library_lists_models_with_a_verdict_and_loads_one(qtbot, app_parts, tmp_path, monkeypatch):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=15000)
    lm_studio = tmp_path / "lmstudio" / "HuggingFaceTB" / "SmolLM2"
    lm_studio.mkdir(parents=True)
    (lm_studio / "smollm2.gguf").write_bytes(starter_path().read_bytes())  # a copy: the starter's own file is listed too
    hub = tmp_path / "hub" / "models--org--huge" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    (hub / "config.json").write_text(json.dumps({**HUGE, "torch_dtype": "bfloat16"}))
    (hub / "model.safetensors").write_bytes(b"\0" * 1024)
    library = open_library(qtbot, win, monkeypatch, [(tmp_path / "hub", "hub cache"), (tmp_path / "lmstudio", "LM Studio")])
    qtbot.waitUntil(lambda: len(library.items("modelCard")) == 3, timeout=30000)
    listed = [c.property("modelName") for c in library.items("modelCard")]
    by_path = cards(library, "modelPath")
    first = library.items("modelCard")[0].property("modelPath")
    assert first == str(starter_path()) and by_path[first][3].property("text") == "Loaded"
    assert listed == ["SmolLM2-135M-Instruct.Q4_1", "org/huge", "smollm2"]  # the file names; the copy is another file
    details, badge, _, load = cards(library)["org/huge"]
    assert details.startswith("llama · 405.9B parameters · bf16 · ") and badge == "too large"
    assert not load.property("enabled")
    assert len(library.items("loadedTag")) == 1  # the copy in LM Studio's folder is another file
    path = str(lm_studio / "smollm2.gguf")
    click(qtbot, library, cards(library, "modelPath")[path][3])
    qtbot.waitUntil(lambda: win.load_bar.isVisible() or bridge.engine.config.model == path)  # the staged load bar
    qtbot.waitUntil(lambda: not bridge.switching and bridge.engine.ready.is_set()
                    and bridge.engine.config.model == path, timeout=150000)
    assert bridge.engine.load_error is None
    qtbot.waitUntil(lambda: (store.setting("engine") or {}).get("model") == path, timeout=10000)


def hub_snapshot(tmp_path, tokenizer, chunks: int, after_first=None):
    """huggingface_hub's snapshot_download without the network: byte progress through the tqdm class
    it is given, then a tiny qwen2 model in the hub cache's layout (models--org--tiny/snapshots/...).
    ``after_first``: an event the download waits for after its first chunk (a slow network)."""
    from tiny_models import tiny_model

    def snapshot(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        bar = tqdm_class(total=chunks * 10 ** 7, unit="B", disable=True)
        for i in range(chunks):
            bar.update(10 ** 7)
            if i == 0 and after_first is not None:
                assert after_first.wait(60)
        folder = tmp_path / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / "abc123"
        tiny_model("qwen2").save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return str(folder)

    return snapshot


def type_hub_id(qtbot, library, text):
    field = library.item("hubId")
    field.setProperty("text", "")
    click(qtbot, library, field)
    qtbot.keyClicks(library.view, text)


def test_a_hub_id_downloads_with_progress_joins_the_list_and_loads(qtbot, engine_parts, tmp_path, tokenizer,
                                                                  monkeypatch):
    """End to end: the real engine switches to the downloaded model."""
    import huggingface_hub

    win, store, bridge, _ = engine_parts
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_snapshot(tmp_path, tokenizer, chunks=5))
    library = open_library(qtbot, win, monkeypatch, [(tmp_path / "empty", "hub cache")])
    before = len(library.items("modelCard"))  # the starter
    seen = []
    library.downloader.progress.connect(lambda *_: seen.append((round(library.progress, 2), library.progressText)))
    type_hub_id(qtbot, library, "org/tiny")
    qtbot.keyClick(library.view, Qt.Key_Return)
    assert library.isDownloading and library.item("downloadBar").isVisible()
    qtbot.waitUntil(lambda: len(library.items("modelCard")) == before + 1, timeout=30000)
    assert [value for value, _ in seen] == [0.2, 0.4, 0.6, 0.8, 1.0] and seen[-1][1] == "org/tiny: 0.05 / 0.05 GB"
    assert not library.isDownloading and "downloaded" in library.status
    details, _, _, load = cards(library)["org/tiny"]
    assert details.startswith("qwen2 · ")
    path = library.models[-1].path
    click(qtbot, library, load)
    qtbot.waitUntil(lambda: not bridge.switching and bridge.engine.config.model == path, timeout=60000)
    assert bridge.load_error is None
    qtbot.waitUntil(lambda: (store.setting("engine") or {}).get("model") == path, timeout=10000)


def test_a_hub_download_can_be_cancelled_and_bad_ids_are_refused(qtbot, tmp_path, tokenizer, monkeypatch):
    import threading

    import huggingface_hub

    from kvchat.app.views.model_library import ModelLibrary

    calls = []
    clicked = threading.Event()
    slow = hub_snapshot(tmp_path, tokenizer, chunks=300, after_first=clicked)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **kw: calls.append(a) or slow(*a, **kw))
    library = ModelLibrary(None, [], None, False, roots=[])
    qtbot.addWidget(library)
    shown(qtbot, library)
    qtbot.waitUntil(lambda: not library.status.startswith("Looking"), timeout=30000)
    listed = len(library.items("modelCard"))
    for typed in ("not-an-id", "a/b/c", "./models/x"):
        type_hub_id(qtbot, library, typed)
        click(qtbot, library, library.item("download"))
        assert "is not a Hugging Face model id" in library.status and not library.isDownloading
    assert not calls
    type_hub_id(qtbot, library, "org/large")
    click(qtbot, library, library.item("download"))
    qtbot.waitUntil(lambda: library.progress > 0, timeout=30000)
    assert "/ 3.00 GB" in library.progressText
    cancel = library.item("cancelDownload")
    qtbot.waitUntil(lambda: cancel.isVisible() and cancel.width() > 0 and cancel.x() > 0)  # laid out where it shows
    click(qtbot, library, cancel)
    assert "cancelling" in library.progressText
    clicked.set()
    qtbot.waitUntil(lambda: not library.isDownloading, timeout=10000)
    assert library.status == "download of org/large cancelled" and len(library.items("modelCard")) == listed
    assert library.item("download").isVisible() and len(calls) == 1


def test_a_hub_download_offline_says_so_in_one_line(qtbot, monkeypatch):
    from kvchat.app.views.model_library import ModelLibrary

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    library = ModelLibrary(None, [], None, False, roots=[])
    qtbot.addWidget(library)
    shown(qtbot, library)
    type_hub_id(qtbot, library, "Qwen/Qwen2.5-0.5B-Instruct")
    with qtbot.waitSignal(library.downloader.failed, timeout=60000):
        click(qtbot, library, library.item("download"))
    text = library.status
    assert "Qwen/Qwen2.5-0.5B-Instruct" in text and "unreachable" in text and "\n" not in text


@pytest.mark.slow
def test_a_gguf_conversion_moves_the_load_bar_tensor_by_tensor(qtbot, app_parts, tmp_path, monkeypatch):
    """A fresh cache: while there is no count (reading the file, making the tokenizer and the
    model) the bar is busy and the label beside it says which; then it counts the tensors up to
    all; then the weights loaded."""
    import gguf

    from kvchat.core.model_source import starter_path

    win, store, bridge, _ = app_parts
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "fresh"))
    model = tmp_path / "smollm2.gguf"
    model.symlink_to(starter_path())
    n = len(gguf.GGUFReader(model).tensors)
    seen = []  # what the user sees after each progress event (the window's slot runs first)
    bridge.load_progress.connect(lambda *_: seen.append((win.load_bar.value(), win.load_bar.maximum(),
                                                         win.load_bar.text(), win.precision_label.text())))
    win.models.load_model({"model": str(model)}, previous=None)
    qtbot.waitUntil(lambda: not bridge.switching, timeout=150000)
    assert bridge.load_error is None
    busy = [label for _, maximum, text, label in seen if maximum == 0]
    assert busy == ["reading GGUF file…", "converting GGUF: the tokenizer…", "converting GGUF: building the model…"]
    assert all(not text for _, maximum, text, _ in seen[:3])  # a busy bar draws no text: the label has it
    converting = [s for s in seen if s[2].startswith("converting")]
    counted = [value for value, maximum, _, _ in converting if maximum == n]
    assert counted == sorted(counted) and counted[-1] == n and len(set(counted)) > n // 2
    assert f"tensor {n} of {n}" in converting[-1][2] and converting[-1][3] == "converting GGUF…"
    loading = seen[3 + len(converting):]  # then the weights, each tensor of the converted model
    assert loading and all(s[2].startswith("loading weights") for s in loading)
    assert [s[0] for s in loading] == sorted(s[0] for s in loading) and loading[-1][0] == loading[-1][1] > 0
    assert win.load_bar.isHidden() and win.precision_label.text().startswith("KV ")  # ready


def test_the_load_bar_stays_put_while_the_stage_beside_it_changes(qtbot, app_parts):
    """The stage label's text grows and shrinks from stage to stage; the bar must not jump sideways."""
    win, _, bridge, _ = app_parts
    win.show()
    win.models.set_loading(True)
    edges = []
    for done, total, stage in ((0, 0, "read"), (0, 0, "tokenizer"), (0, 0, "model"), (5, 272, "convert"),
                               (272, 272, "convert"), (9, 272, "weights")):
        bridge.load_progress.emit(done, total, stage)
        QApplication.processEvents()  # the layout request, posted by the label's new text
        left = win.load_bar.mapTo(win, QPoint(0, 0)).x()
        edges.append((left, left + win.load_bar.width()))
    assert len(set(edges)) == 1, edges


def test_the_library_draws_its_buttons_and_field_in_the_dark_theme(qtbot, app_parts, tmp_path, monkeypatch):
    """Issue 29: in the dark theme the library's buttons and hub field stayed light."""
    win, _, _, _ = app_parts
    shown(qtbot, win)
    while win.theme.mode != "dark":  # system, light, dark: the button cycles
        qtbot.mouseClick(win.theme_button, Qt.LeftButton)
    library = open_library(qtbot, win, monkeypatch, [(tmp_path / "empty", "hub cache")])
    frame = library.view.grabFramebuffer()

    def lightness(name):
        item = library.item(name)
        point = item.mapToScene(QPointF(item.width() / 2, 3)).toPoint()  # above the label's text
        return frame.pixelColor(point).lightnessF()

    dark_bg = QColor(COLOURS[True]["bg"]).lightnessF()
    for name in ("closeLibrary", "addFolder", "openGguf", "download", "hubId"):
        assert lightness(name) < dark_bg + 0.15, name  # the stock Fusion button is 0.9 light
    click(qtbot, library, library.item("closeLibrary"))
    qtbot.waitUntil(lambda: not library.isVisible())
