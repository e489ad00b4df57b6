"""The kvchat command, as a user runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

KVCHAT = str(Path(sys.executable).parent / "kvchat")


def kvchat(*args, stdin=None, timeout=300):
    return subprocess.run([KVCHAT, *args], input=stdin, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "KVCHAT_HOME": os.environ["KVCHAT_HOME"]})


def test_generate_json_holds_text_ids_and_stats(starter):
    r = kvchat("generate", "--prompt", "What is the capital of France?", "--temperature", "0",
               "--max-new-tokens", "16", "--json", "--context", "512")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert "Paris" in out["text"]
    assert out["token_ids"] and set(out["stats"]) >= {"prompt_tokens", "cached_tokens", "generated_tokens",
                                                      "ttft_ms", "decode_tok_s"}
    assert out["stats"]["generated_tokens"] == len(out["token_ids"])


def test_chat_commands(starter):
    script = "Hello!\n/stats\n/system You are a pirate.\nWho are you?\n/stats\n/reset\n/quit\n"
    r = kvchat("chat", "--temperature", "0", "--max-new-tokens", "8", "--context", "512", stdin=script)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("cached") == 2 and "[persona set; conversation reset]" in r.stdout
    assert "[conversation reset]" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["generate", "--model", "/no/such.gguf", "--prompt", "hi"], "no such model file"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be a positive integer"),
    (["generate", "--prompt", "   "], "no non-empty user message"),
    (["generate", "--prompt", "word " * 600, "--context", "256"], "longer than the context"),
])
def test_bad_input_is_one_line_and_nonzero(starter, args, message):
    r = kvchat(*args)
    assert r.returncode == 1
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvchat: error")]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_corrupt_gguf_is_one_line(tmp_path, starter):
    bad = tmp_path / "cut.gguf"
    from kvchat.engine.models import starter_path

    bad.write_bytes(starter_path().read_bytes()[:100_000])
    r = kvchat("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 1 and "cannot read GGUF file" in r.stderr and "Traceback" not in r.stderr
