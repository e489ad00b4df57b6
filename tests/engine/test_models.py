"""Model sources: HF folder, .gguf (the starter), hub id (offline here), and bad inputs."""
import hashlib
import os

import pytest
import torch

from kvchat.engine.model import loading as models
from kvchat.core.model_source import ModelError, resolve, starter_path
from kvchat.engine.model.loading import load

from tiny_models import tiny_model, write_tiny_gguf


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("qwen2-tiny")
    tiny_model("qwen2").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_folder_loads_with_its_tokenizer(hf_folder):
    lm = load(str(hf_folder))
    assert lm.source.kind == "folder" and lm.model.config.model_type == "qwen2"
    assert lm.dtype == torch.float32 and lm.identity.startswith("folder:")
    assert lm.tokenizer("hi")["input_ids"]
    assert load(str(hf_folder / "config.json")).identity == lm.identity


def test_starter_resolves_to_the_packaged_gguf_and_identity_is_its_hash(starter):
    src = resolve("starter")
    assert src.kind == "starter" and src.location.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert starter.identity == "gguf:" + models.file_digest(starter_path())
    assert starter.model.config.model_type == "llama"


def test_gguf_path_loads_through_the_converted_cache(starter):
    lm = load(str(starter_path()))
    assert lm.source.kind == "gguf" and lm.identity == starter.identity
    assert torch.equal(lm.model.model.embed_tokens.weight, starter.model.model.embed_tokens.weight)


def test_truncated_gguf_is_a_one_line_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(starter_path().read_bytes()[:300_000])
    with pytest.raises(ModelError, match="cannot read GGUF file") as info:
        load(str(bad))
    assert "\n" not in str(info.value)


def test_garbage_gguf_is_a_one_line_error(tmp_path):
    bad = tmp_path / "noise.gguf"
    bad.write_bytes(b"not a gguf at all" * 100)
    with pytest.raises(ModelError, match="cannot read GGUF file"):
        load(str(bad))
    import gguf

    assert gguf.GGUFReader.__name__ == "GGUFReader"  # parsed before anything was swapped


@pytest.mark.parametrize("spec, message", [
    ("/no/such/dir/model.gguf", "no such model file"),
    ("./nothing-here", "no such model"),
    ("a/b/c", "no such model"),
])
def test_unknown_sources_are_named(spec, message):
    with pytest.raises(ModelError, match=message):
        resolve(spec)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve(str(tmp_path))


def test_hub_id_offline_is_a_one_line_error_naming_the_id(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as info:
        load("Qwen/Qwen2.5-0.5B-Instruct")
    assert "Qwen/Qwen2.5-0.5B-Instruct" in str(info.value) and "\n" not in str(info.value)


def test_hub_download_reports_progress_in_bytes(monkeypatch, hf_folder):
    """The real download path, with the network replaced by huggingface_hub's own tqdm calls."""
    import huggingface_hub

    seen = []

    def fake_snapshot(repo_id, allow_patterns=None, tqdm_class=None, **kw):
        bar = tqdm_class(total=1000, unit="B", disable=True)
        bar.update(400)
        bar.update(600)
        bar.close()
        return str(hf_folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    path = models.download("org/tiny", progress=lambda done, total: seen.append((done, total)))
    assert path == hf_folder
    assert seen == [(400, 1000), (1000, 1000)]


def test_a_files_digest_is_hashed_once_and_again_when_the_file_changes(monkeypatch, tmp_path):
    """Each start hashed the whole model file (the starter: 0.13 s); now its size and time tell."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    f = tmp_path / "model.gguf"
    f.write_bytes(b"first" * 1000)
    assert models.file_digest(f) == hashlib.sha256(b"first" * 1000).hexdigest()
    opened = []
    monkeypatch.setattr(models, "open", lambda *a, **k: opened.append(a) or open(*a, **k), raising=False)
    assert models.file_digest(f) == hashlib.sha256(b"first" * 1000).hexdigest() and not opened
    f.write_bytes(b"other" * 1000)  # the same size: the time tells
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000_000))
    assert models.file_digest(f) == hashlib.sha256(b"other" * 1000).hexdigest() and len(opened) == 1
    (tmp_path / "home" / "cache" / "digests.json").write_text("{not json")
    assert models.file_digest(f) == hashlib.sha256(b"other" * 1000).hexdigest()  # a broken memo: hashed again


def test_quantized_weights_need_cuda():
    with pytest.raises(ModelError, match="need a CUDA GPU"):
        models._bnb_config("nf4", torch.device("cpu"), torch.float32)


def test_a_gguf_conversion_reports_each_tensor_and_a_cancel_stops_it(monkeypatch, tmp_path):
    """A fresh cache: stages "read", "tokenizer" and "model" with no count, then (i, n) after each of
    its n tensors; raising in the callback (the engine's cancel) stops the conversion with that
    reason. On a tiny GGUF: the starter's own conversion is the suite's first load and the package
    check's first reply."""
    import gguf

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "fresh"))
    path = tmp_path / "tiny.gguf"
    n = write_tiny_gguf(path)
    digest = models.file_digest(path)

    def cancel_at_10(done, total, stage):
        if done == 10:
            raise ModelError("loading cancelled")

    with pytest.raises(ModelError, match="^loading cancelled$"):
        models.gguf_to_folder(path, digest, cancel_at_10)
    assert not list((tmp_path / "fresh").rglob("done"))
    assert gguf.GGUFReader.__name__ == "GGUFReader"  # transformers and gguf are as they were

    seen = []
    folder = models.gguf_to_folder(path, digest, lambda *a: seen.append(a))
    assert (folder / "done").is_file() and models.converted_problem(folder) is None
    assert n == len(gguf.GGUFReader(path).tensors)
    assert seen[:3] == [(0, 0, "read"), (0, 0, "tokenizer"), (0, 0, "model")]
    assert seen[3:] == [(i, n, "convert") for i in range(n + 1)]
    seen.clear()
    assert models.gguf_to_folder(path, digest, lambda *a: seen.append(a)) == folder and not seen  # cached


@pytest.mark.slow
def test_the_gguf_header_reads_as_gguf_reader_does(tmp_path):
    """The library's header reader against gguf's own on the starter: every field (an array as its
    type and length), every tensor's element count; a cut or foreign file is a ValueError."""
    import gguf

    from kvchat.core.gguf_header import Array, read_header

    path = starter_path()
    header, reader = read_header(path), gguf.GGUFReader(path)
    fields = {name: f for name, f in reader.fields.items() if not name.startswith("GGUF.")}  # its own counters
    assert set(header.metadata) == set(fields) and len(fields) == 33
    for name, f in fields.items():
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            want = Array(int(f.types[1]), len(f.data))
        elif f.types[0] == gguf.GGUFValueType.STRING:
            want = bytes(f.parts[f.data[0]]).decode()
        else:
            want = f.parts[f.data[0]].tolist()[0]
        assert header.metadata[name] == want, name
    assert header.metadata["tokenizer.ggml.tokens"] == Array(8, 49152)
    assert header.tensors == {t.name: int(t.n_elements) for t in reader.tensors} and len(header.tensors) == 272
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:300_000])
    with pytest.raises(ValueError, match="not a complete GGUF header"):
        read_header(cut)
    foreign = tmp_path / "foreign.gguf"
    foreign.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_header(foreign)


def test_a_models_api_id_is_one_word():
    from kvchat.core.model_source import ModelSource

    ids = [ModelSource(kind, location).api_id for kind, location in (
        ("starter", ""), ("hub", "Qwen/Qwen2.5-0.5B-Instruct"), ("gguf", "/home/ana/My Models/llama 3.Q4_K_M.gguf"),
        ("folder", "/models/Mistral-7B-Instruct-v0.3/"))]
    assert ids == ["SmolLM2-135M-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "llama-3.Q4_K_M", "Mistral-7B-Instruct-v0.3"]
