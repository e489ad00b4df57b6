"""The model library's reading of a GGUF's header (core/model_library.gguf_config) against the
config transformers' GGUF loader makes of the same file, which is the model the engine runs: the
planner's KV shape and windows from either must agree."""
import numpy as np
import pytest
from transformers import AutoConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from kvchat.core.gguf_header import read_header
from kvchat.core.kv_sizes import KVShape
from kvchat.core.model_library import gguf_config

from tiny_models import gguf_writer, write_gguf

# the sizes of the real models, a header and one tensor each: (architecture, metadata)
HEADERS = {
    "gemma-3-4b": ("gemma3", dict(layers=34, hidden=2560, ffn=10240, heads=8, kv=4, key=256, window=1024)),
    "gemma-2-9b": ("gemma2", dict(layers=42, hidden=3584, ffn=14336, heads=16, kv=8, key=256, window=4096)),
    "qwen3-0.6b": ("qwen3", dict(layers=28, hidden=1024, ffn=3072, heads=16, kv=8, key=128)),
    "llama-3.2-1b": ("llama", dict(layers=16, hidden=2048, ffn=8192, heads=32, kv=8)),
}


def write_header(path, arch: str, meta: dict) -> None:
    w = gguf_writer(path, arch, meta["layers"], meta["hidden"], meta["ffn"], meta["heads"], meta["kv"], context=8192)
    if "key" in meta:
        w.add_key_length(meta["key"])
        w.add_value_length(meta["key"])
    if "window" in meta:
        w.add_sliding_window(meta["window"])
    w.add_token_list(["a", "b", "c"])
    w.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    write_gguf(w)


@pytest.mark.parametrize("name", sorted(HEADERS))
def test_the_library_reads_a_gguf_as_transformers_loads_it(tmp_path, name):
    arch, meta = HEADERS[name]
    path = tmp_path / f"{name}.gguf"
    write_header(path, arch, meta)
    parsed = dict(load_gguf_checkpoint(str(path), return_tensors=False)["config"])
    made = AutoConfig.for_model(parsed.pop("model_type"), **parsed)
    ours = gguf_config(read_header(path))
    assert ours["model_type"] == made.model_type
    assert KVShape.from_config(ours) == KVShape.from_config(made)
    assert KVShape.from_config(ours).head_dim == meta.get("key", meta["hidden"] // meta["heads"])
