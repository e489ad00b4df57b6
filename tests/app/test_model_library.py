"""The model library (issue 10, deliverable 3): models on disk with what they are and whether they fit
here, before loading; one click loads one, and it is saved only once it has loaded; the load bar.
The fake backend (tests/support) loads them, but for the hub model, loaded end to end by a real engine."""
import json

from PySide6.QtCore import QPoint, Qt
from PySide6.QtWidgets import QApplication

from kvchat.core.model_source import starter_path

from qt_helpers import shown

HUGE = {"model_type": "llama", "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
        "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072}  # a 405B shape: no machine here holds it


def test_the_library_lists_models_with_a_verdict_and_loads_one(qtbot, app_parts, tmp_path):
    win, store, bridge, _ = app_parts
    shown(qtbot, win)
    qtbot.waitUntil(lambda: win.gauge.updates >= 1, timeout=15000)
    lm_studio = tmp_path / "lmstudio" / "HuggingFaceTB" / "SmolLM2"
    lm_studio.mkdir(parents=True)
    (lm_studio / "smollm2.gguf").symlink_to(starter_path())
    hub = tmp_path / "hub" / "models--org--huge" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    (hub / "config.json").write_text(json.dumps(HUGE))
    (hub / "model.safetensors").write_bytes(b"\0" * 1024)
    library = win.models.library(roots=[(tmp_path / "hub", "hub cache"), (tmp_path / "lmstudio", "LM Studio")])
    qtbot.addWidget(library)
    library.show()
    qtbot.waitUntil(lambda: library.table.rowCount() == 2, timeout=30000)
    table = library.table
    rows = {table.item(r, 1).text(): [table.item(r, c).text() for c in range(table.columnCount())]
            for r in range(2)}
    name, source, arch, params, size, trained, fits = rows["LM Studio"]
    assert (arch, params, trained) == ("llama", "135M", "8,192") and size == "0.09 GiB"
    assert fits.startswith("fits 8k tokens at")  # capped at the trained context
    assert rows["hub cache"][0] == "org/huge" and rows["hub cache"][3] == "405.9B" and rows["hub cache"][6] == "too large"
    row = next(r for r in range(2) if table.item(r, 1).text() == "LM Studio")
    qtbot.mouseClick(table.viewport(), Qt.LeftButton, pos=table.visualItemRect(table.item(row, 0)).center())
    path = str(lm_studio / "smollm2.gguf")
    qtbot.mouseClick(library.load_button, Qt.LeftButton)
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


def test_a_hub_id_downloads_with_progress_joins_the_list_and_loads(qtbot, engine_parts, tmp_path, tokenizer,
                                                                  monkeypatch):
    """End to end: the real engine switches to the downloaded model."""
    import huggingface_hub

    win, store, bridge, _ = engine_parts
    monkeypatch.setattr(huggingface_hub, "snapshot_download", hub_snapshot(tmp_path, tokenizer, chunks=5))
    library = win.models.library(roots=[(tmp_path / "empty", "hub cache")])
    qtbot.addWidget(library)
    shown(qtbot, library)
    qtbot.waitUntil(lambda: "No models found" in library.status.text(), timeout=30000)
    seen = []
    library.downloader.progress.connect(lambda *_: seen.append((library.download_bar.value(),
                                                                 library.download_bar.format())))
    qtbot.keyClicks(library.hub_id, "org/tiny")
    qtbot.keyClick(library.hub_id, Qt.Key_Return)
    assert library.download_bar.isVisible() and not library.download_button.isEnabled()
    qtbot.waitUntil(lambda: library.table.rowCount() == 1, timeout=30000)
    assert [value for value, _ in seen] == [200, 400, 600, 800, 1000] and seen[-1][1] == "org/tiny: 0.05 / 0.05 GB"
    assert library.download_bar.isHidden() and "downloaded" in library.status.text()
    cells = [library.table.item(0, c).text() for c in range(library.table.columnCount())]
    assert cells[:3] == ["org/tiny", "hub cache", "qwen2"]
    assert library.table.selectionModel().selectedRows()[0].row() == 0  # selected: Load uses it
    path = library.models[0].path
    qtbot.mouseClick(library.load_button, Qt.LeftButton)
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
    for typed in ("not-an-id", "a/b/c", "./models/x"):
        library.hub_id.setText(typed)
        qtbot.mouseClick(library.download_button, Qt.LeftButton)
        assert "is not a Hugging Face model id" in library.status.text() and library.download_bar.isHidden()
    assert not calls
    library.hub_id.setText("org/large")
    qtbot.mouseClick(library.download_button, Qt.LeftButton)
    qtbot.waitUntil(lambda: library.download_bar.value() > 0, timeout=30000)
    assert "/ 3.00 GB" in library.download_bar.format()
    qtbot.mouseClick(library.cancel_download_button, Qt.LeftButton)
    clicked.set()
    qtbot.waitUntil(lambda: library.download_bar.isHidden(), timeout=10000)
    assert library.status.text() == "download of org/large cancelled" and library.table.rowCount() == 0
    assert library.download_button.isEnabled() and len(calls) == 1


def test_a_hub_download_offline_says_so_in_one_line(qtbot, monkeypatch):
    from kvchat.app.views.model_library import ModelLibrary

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    library = ModelLibrary(None, [], None, False, roots=[])
    qtbot.addWidget(library)
    library.hub_id.setText("Qwen/Qwen2.5-0.5B-Instruct")
    with qtbot.waitSignal(library.downloader.failed, timeout=60000):
        qtbot.mouseClick(library.download_button, Qt.LeftButton)
    text = library.status.text()
    assert "Qwen/Qwen2.5-0.5B-Instruct" in text and "unreachable" in text and "\n" not in text
    assert library.download_bar.isHidden()


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
