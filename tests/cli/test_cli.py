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


QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def greedy_answer(starter):
    """One greedy generate, read by two tests: each start of the command costs 4-5 s."""
    return kvchat("generate", "--prompt", QUESTION, "--temperature", "0", "--max-new-tokens", "16", "--json",
                  "--context", "512", "--kv-precision", "fp16")


def test_generate_json_holds_text_ids_and_stats(greedy_answer):
    r = greedy_answer
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
    from kvchat.core.model_source import starter_path

    bad.write_bytes(starter_path().read_bytes()[:100_000])
    r = kvchat("generate", "--model", str(bad), "--prompt", "hi")
    assert r.returncode == 1 and "cannot read GGUF file" in r.stderr and "Traceback" not in r.stderr


def test_connections_add_list_remove_keep_the_key_in_the_keyring(tmp_path):
    """``kvchat connections`` with a file-backed fake keyring (PYTHON_KEYRING_BACKEND), in a home of its own."""
    ring = tmp_path / "keyring.json"
    env = {**os.environ, "KVCHAT_HOME": str(tmp_path / "home"), "KVCHAT_TEST_KEYRING": str(ring),
           "PYTHON_KEYRING_BACKEND": "fake_keyring.FileKeyring",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1] / "engine"), os.environ.get("PYTHONPATH", "")])}

    def run(*args, stdin=None):
        return subprocess.run([KVCHAT, "connections", *args], input=stdin, capture_output=True, text=True,
                              timeout=60, env=env)

    added = run("add", "lab", "http://gpu-box:8000", "--model", "llama-70b", "--api-key-stdin", stdin="s3cret\n")
    assert added.returncode == 0 and "saved lab" in added.stdout, added.stderr
    # saved as used: a scheme where none was typed, no endpoint pasted from a client's config
    assert run("add", "home", "127.0.0.1:8080/v1/chat/completions/").returncode == 0
    listed = run("list")
    assert listed.stdout.splitlines() == ["lab\thttp://gpu-box:8000\tllama-70b\tkey in keyring",
                                          "home\thttp://127.0.0.1:8080/v1\t(first model)\tno key"]
    saved = (tmp_path / "home" / "config" / "connections.json").read_text()
    assert "s3cret" not in saved and "s3cret" not in listed.stdout
    assert json.loads(ring.read_text()) == {"kvchat/connection:lab": "s3cret"}
    assert run("remove", "lab").returncode == 0
    assert json.loads(ring.read_text()) == {} and run("list").stdout.splitlines()[0].startswith("home\t")


@pytest.mark.parametrize("args, stdin, message", [
    (["add", "x", "ftp://gpu-box"], None, "is not a server's base URL"),
    (["add", "x", "http://gpu-box:eighty"], None, "port that is not a number"),
    (["add", " ", "http://gpu-box:8000"], None, "needs a name"),
    (["add", "x", "http://ada:s3cret@gpu-box:8000"], None, "would be saved in plain text"),
    (["add", "x", "https://sk-123@gpu-box"], None, "would be saved in plain text"),
    (["add", "x", "http://gpu-box:8000", "--api-key-stdin"], "", "read no key"),
    (["remove", "nobody"], None, "no saved connection named 'nobody'"),
    ([], None, "say what to do"),
])
def test_connections_bad_input_is_one_line(tmp_path, args, stdin, message):
    r = subprocess.run([KVCHAT, "connections", *args], input=stdin, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVCHAT_HOME": str(tmp_path)})
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvchat: error")]
    assert r.returncode == 1 and len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "config" / "connections.json").exists()


def one_error_line(r, message):
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvchat: error")]
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.fixture(scope="module")
def taken_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("args, message", [
    (["--port", "70000"], "--port must be in 1..65535"),
    (["--port", "0"], "--port must be in 1..65535"),
    (["--max-queue", "0"], "--max-queue must be positive"),
    (["--api-key", ""], "--api-key (or $KVCHAT_API_KEY) is empty"),
    (["--api-key", "  "], "--api-key (or $KVCHAT_API_KEY) is empty"),
    (["--host", "no-such-host.invalid"], "--host no-such-host.invalid: not an address"),
    (["--host", "192.0.2.1"], "cannot serve on 192.0.2.1"),
    (["--cors-origin", "*"], "--cors-origin takes an origin"),
    (["--cors-origin", "http://app.example/path"], "--cors-origin takes an origin"),
    (["--allow-host", ""], "--allow-host takes a host name"),
    (["--threads", "0"], "threads must be a positive integer"),
    (["--context", "0"], "--context must be a positive"),
    (["--model", "/no/such.gguf"], "no such model file or folder"),
])
def test_serve_refuses_bad_arguments_in_one_line_before_loading(args, message):
    one_error_line(kvchat("serve", *args, timeout=60), message)


def test_serve_on_a_taken_port_is_one_line(taken_port):
    one_error_line(kvchat("serve", "--port", str(taken_port), timeout=60), f"cannot serve on 127.0.0.1:{taken_port}")


@pytest.mark.parametrize("args, message", [
    (["bench", "decode", "--random-weights", "/nonexistent"], "--random-weights /nonexistent: no such file"),
    (["eval", "ppl", "--text", "/nonexistent"], "--text /nonexistent: no such file"),
    (["eval", "ppl", "--kv-precision", "int8,int5"], "--kv-precision int8,int5: choose from"),
])
def test_missing_paths_are_one_line(args, message):
    one_error_line(kvchat(*args, timeout=60), message)


def test_version_and_every_bench_in_the_help():
    version = kvchat("--version", timeout=60)
    from importlib.metadata import version as installed

    assert version.returncode == 0 and version.stdout.strip() == f"kvchat {installed('kvchat')}"
    helped = kvchat("bench", "--help", timeout=60)
    assert helped.returncode == 0 and "speculate,ui}" in helped.stdout and "ui: the window's CPU time" in helped.stdout


def test_a_bench_refuses_options_it_does_not_read_and_says_which_it_reads(capsys):
    """``bench api --weights int4`` measured the default weights and said nothing of it."""
    from kvchat.cli.main import main

    assert main(["bench", "api", "--weights", "int4", "--kv-precision", "int8"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvchat: error: bench api does not read --weights, --kv-precision; it reads --api-key, --clients, "
        "--max-tokens, --model, --remote and --json"]
    assert main(["bench", "kernels", "--model", "x", "--json"]) == 1
    assert "bench kernels does not read --model; it reads --compile and --json" in capsys.readouterr().err
    # decode reads both, but measures random weights of the shape, leaving a model unread
    assert main(["bench", "decode", "--model", "org/name", "--random-weights", "shape.json"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvchat: error: give --model or --random-weights, not both: --random-weights measures random weights of "
        "that shape and would leave --model unread"]
    from kvchat.cli.bench import unread_options
    from kvchat.cli.main import parser

    for args in (["bench", "decode", "--weights", "int4", "--kv-precision", "int8", "--json"],  # what it reads
                 ["bench", "api", "--weights", "none", "--clients", "4"],  # at the default: not given
                 ["bench", "capped", "--random-weights", "x.json", "--memory", "2GiB", "--device", "cpu"],
                 ["bench", "speculate", "--clients", "4", "--max-tokens", "64", "--repeats", "2"]):
        assert unread_options(parser().parse_args(args)) == []
    assert main(["bench", "speculate", "--weights", "int4"]) == 1
    assert ("bench speculate does not read --weights; it reads --clients, --kv-precision, --max-tokens, --model, "
            "--repeats and "
            "--json") in capsys.readouterr().err


def test_speculate_auto_or_off_reaches_the_engine_config_of_every_engine_command():
    from kvchat.cli.main import make_config, parser

    for command in (["serve"], ["chat"], ["generate", "--prompt", "hi"]):
        assert make_config(parser().parse_args(command)).speculate is True
        assert make_config(parser().parse_args([*command, "--speculate", "off"])).speculate is False


def test_generate_says_what_it_capped_and_takes_a_tiny_top_p(greedy_answer):
    """A top_p of 1e-300 keeps only the likeliest token: the greedy answer, token for token."""
    r = kvchat("generate", "--prompt", QUESTION, "--max-new-tokens", "16", "--json", "--context", "100000",
               "--threads", "10000", "--top-p", "1e-300", "--temperature", "0.7", "--kv-precision", "fp16")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert f"--threads 10000 capped at {os.cpu_count()}" in r.stderr
    assert "--context 100,000 capped at 8,192 tokens" in r.stderr
    assert greedy_answer.returncode == 0, greedy_answer.stderr
    assert json.loads(r.stdout)["token_ids"] == json.loads(greedy_answer.stdout)["token_ids"]


def test_a_url_with_credentials_is_never_written(tmp_path):
    from kvchat.core.connections import Connection, Connections

    saved = Connections(tmp_path / "connections.json")
    with pytest.raises(ValueError, match="plain text"):
        saved.save(Connection("lab", "http://ada:s3cret@gpu-box:8000"))
    assert not (tmp_path / "connections.json").exists()


def test_eval_ppl_scores_several_texts_and_precisions_in_one_json_document(tmp_path, starter):
    """Each text under its own kind (its file name), fp16 first, then each precision asked for, with
    the increase against that text's own fp16 figure."""
    from kvchat.bench.evaluate import TEXTS

    prose, code = tmp_path / "prose.txt", tmp_path / "code.txt"
    prose.write_text((TEXTS / "prose.txt").read_text()[:1000])
    code.write_text((TEXTS / "code.txt").read_text()[:600])  # one window of 128 tokens (and a few), as the prose's
    r = kvchat("eval", "ppl", "--text", str(prose), "--text", str(code), "--kv-precision", "int8,int4",
               "--context", "128", "--chunk", "32", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["context"], report["chunk"]) == (128, 32)
    assert [t["kind"] for t in report["texts"]] == ["prose", "code"]
    for text in report["texts"]:
        rows = text["results"]
        assert [row["precision"] for row in rows] == ["fp16", "int8", "int4"] and rows[0]["increase_pct"] == 0
        assert all(row["scored_tokens"] == rows[0]["scored_tokens"] > 0 for row in rows)
        for row in rows[1:]:
            assert abs(row["increase_pct"] - 100 * (row["ppl"] / rows[0]["ppl"] - 1)) < 1e-9


def test_the_shipped_eval_texts_hold_the_windows_their_readme_promises(starter):
    """Two windows of 4,096 tokens each (the chat transcript one), in the starter's tokenizer; the
    held-out set after the shipped one, each set alone on asking."""
    from kvchat.bench.evaluate import HELD_OUT, KINDS, read_texts

    texts = read_texts(None)
    assert [(group, kind) for group, kind, _, _ in texts] == [("shipped", k) for k in KINDS] + [
        ("held-out", k) for k in HELD_OUT]
    assert [kind for _, kind, _, _ in read_texts(None, "held-out")] == list(HELD_OUT)
    assert [kind for _, kind, _, _ in read_texts(None, "shipped")] == list(KINDS)
    for _, kind, _, text in texts:
        tokens = len(starter.tokenizer(text, add_special_tokens=False)["input_ids"])
        assert tokens >= (4096 if kind == "chat" else 8192), (kind, tokens)
