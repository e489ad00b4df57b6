"""The model library (issue 10, deliverable 3): models on disk with what they are and whether they fit
here, before loading; one click loads one, and it is saved only once it has loaded."""
import json

from PySide6.QtCore import Qt

from kvchat.engine.models import starter_path

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
    library = win.model_library(roots=[(tmp_path / "hub", "hub cache"), (tmp_path / "lmstudio", "LM Studio")])
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
