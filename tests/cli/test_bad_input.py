"""Extreme but legal values, broken files and bad configs: one clear line, never a traceback or
a nan."""
import json
import os
import time

import pytest
import torch

from kvchat.engine.model import loading as models
from kvchat.core.config import ConfigError, EngineConfig, SamplingParams
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.sampler import Sampler

from test_cli import kvchat

LOGITS = torch.tensor([1.0, 3.0, 2.5, -1.0])


@pytest.mark.parametrize("params", [dict(temperature=1e-300), dict(temperature=1e-45),
                                    dict(temperature=0.7, repetition_penalty=1e-300)])
def test_near_zero_temperature_or_penalty_is_greedy_not_nan(params):
    sampler = Sampler(SamplingParams(**params, seed=1))
    seen = torch.tensor([0, 1]) if "repetition_penalty" in params else None
    penalised = LOGITS.clone()
    if seen is not None:
        penalised[seen] = torch.where(LOGITS[seen] > 0, LOGITS[seen] / 1e-300, LOGITS[seen] * 1e-300)
    assert sampler(LOGITS, seen) == int(torch.argmax(penalised))


def test_seeds_are_taken_modulo_2_64():
    assert SamplingParams(seed=2 ** 64 + 5).seed == 5 and SamplingParams(seed=-1).seed == 2 ** 64 - 1
    draws = [Sampler(SamplingParams(temperature=1.0, seed=s))(torch.zeros(1000)) for s in (5, 2 ** 64 + 5)]
    assert draws[0] == draws[1]


@pytest.mark.parametrize("threads", [0, -1])
def test_threads_must_be_positive(threads):
    with pytest.raises(ConfigError, match="threads must be a positive integer"):
        EngineConfig(threads=threads)


def fill(folder, name, size, age=0.0):
    path = folder / name
    path.write_bytes(b"\0" * size)
    stamp = time.time() - age
    os.utime(path, (stamp, stamp))
    return path


def test_the_disk_tiers_cap_holds_past_a_folder_named_like_an_entry_and_counts_tmp_files(tmp_path):
    tier = DiskTier(tmp_path, cap_bytes=3000)
    (tmp_path / "x.kvb").mkdir()
    oldest = fill(tmp_path, "a.kvb", 1000, age=50)
    fill(tmp_path, "b.kvb", 1000, age=40)
    stale = fill(tmp_path, "c.123.tmp", 1000, age=3600)  # a write that died an hour ago
    live = fill(tmp_path, "d.456.tmp", 1000, age=1)  # a write under way elsewhere: counted, kept
    newest = fill(tmp_path, "e.kvb", 1000)
    tier.trim()
    assert not stale.exists() and not oldest.exists()
    assert live.exists() and newest.exists() and (tmp_path / "x.kvb").is_dir()
    files = [p for p in tmp_path.iterdir() if p.is_file() and p.name != ".lock"]
    assert sum(p.stat().st_size for p in files) <= 3000


def test_a_converted_model_cut_short_on_disk_is_converted_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(models, "cache_dir", lambda: tmp_path)
    folder = tmp_path / "converted" / ("ab" * 16)
    folder.mkdir(parents=True)
    from safetensors.torch import save_file

    save_file({"w": torch.ones(1000)}, folder / "model.safetensors")
    size = (folder / "model.safetensors").stat().st_size
    (folder / "done").write_text(json.dumps({"source": "x.gguf", "size": size}))
    converted = []
    monkeypatch.setattr(models, "_convert_gguf", lambda path, where, progress: converted.append(where))
    assert models.gguf_to_folder(tmp_path / "x.gguf", "ab" * 32) == folder and converted == []
    with open(folder / "model.safetensors", "r+b") as f:
        f.truncate(size // 2)
    assert models.gguf_to_folder(tmp_path / "x.gguf", "ab" * 32) == folder
    assert converted == [folder] and not folder.exists()  # deleted, then made again
    assert str(folder) in caplog.text and "damaged" in caplog.text


BAD_CONFIGS = {
    "malformed.json": ("{not json", "not a readable config.json"),
    "empty.json": ("", "not a readable config.json"),
    "list.json": ("[1, 2]", "not a model config"),
    "partial.json": (json.dumps({"model_type": "llama", "hidden_size": 64}), "num_hidden_layers must be"),
    "zero_heads.json": (json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                    "num_attention_heads": 0, "intermediate_size": 128, "vocab_size": 100}),
                        "num_attention_heads must be a positive integer"),
    "gpt2.json": (json.dumps({"model_type": "gpt2", "n_embd": 768, "n_head": 12, "n_layer": 12}),
                  "architecture 'gpt2' is not supported"),
}


@pytest.mark.parametrize("name", sorted(BAD_CONFIGS))
def test_plan_with_a_bad_config_is_one_line(tmp_path, name):
    text, message = BAD_CONFIGS[name]
    (tmp_path / name).write_text(text)
    r = kvchat("plan", "--model", str(tmp_path / name), "--context", "4096", "--memory", "24GiB")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and message in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--temperature", "1e-300", "--seed", str(2 ** 64)], None),
    (["--threads", "-1"], "threads must be a positive integer"),
    (["--threads", "0"], "threads must be a positive integer"),
    (["--prompt", os.fsdecode(b"caf\xe9 \xff")], "not valid UTF-8"),
])
def test_generate_with_extreme_arguments_is_one_line(starter, args, message):
    argv = ["generate", "--context", "512", "--max-new-tokens", "4", "--json"]
    argv += args if "--prompt" in args else args + ["--prompt", "hi"]
    r = kvchat(*argv)
    assert "Traceback" not in r.stderr, r.stderr
    if message is None:
        assert r.returncode == 0 and len(json.loads(r.stdout)["token_ids"]) == 4
    else:
        lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvchat: error")]
        assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr


def test_ctrl_c_in_the_terminal_chat_stops_the_reply_not_the_chat(starter):
    import signal
    import subprocess

    from test_cli import KVCHAT

    # a suite started in the background by a shell without job control inherits SIGINT ignored, and
    # Python then keeps ignoring it: the chat must get Ctrl-C as a terminal would give it
    chat = subprocess.Popen([KVCHAT, "chat", "--temperature", "0", "--max-new-tokens", "400", "--context", "512"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "KVCHAT_HOME": os.environ["KVCHAT_HOME"]},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    chat.stdin.write(b"Write a long story about a dragon who learns to sail.\n")
    chat.stdin.flush()
    seen = b""
    while seen.count(b"you> ") < 1 or len(seen.split(b"you> ", 1)[1]) < 40:  # the reply has begun
        seen += os.read(chat.stdout.fileno(), 64)
    chat.send_signal(signal.SIGINT)
    out, err = chat.communicate(b"/stats\n/quit\n", timeout=120)
    text = (seen + out).decode()
    assert chat.returncode == 0 and "Traceback" not in err.decode(), err.decode()
    assert "[stopped]" in text
    generated = int(text.split("generated ")[1].split(",")[0])
    assert 1 <= generated < 400
