"""The remote backend against a real server: ``kvchat serve`` started as its own process on a free
loopback port with an API key (one per module), and llama.cpp's server when one is on PATH."""
import json
import os
import shutil
import subprocess
import sys
import time

import httpx
import keyring
import pytest

from kvchat.core.backend import Backend
from kvchat.core.config import SamplingParams
from kvchat.core.events import EngineError, Finished, Request, TokenDelta
from kvchat.remote.client import RemoteBackend, api_root
from kvchat.remote.metrics import server_memory

from fake_keyring import MemoryKeyring
from serve_process import free_port, kvchat_serve, wait_for

KEY = "remote-test-key"
PERSONA = "You are Ada, a patient tutor of mathematics. " * 50  # about 500 tokens
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with kvchat_serve(tmp_path_factory.mktemp("serve"), KEY) as url:
        yield url


@pytest.fixture(scope="module")
def backend(server):
    b = RemoteBackend(server, api_key=KEY, metrics_period=0.2)
    b.wait_ready(30)
    yield b
    b.close()


def metrics(server) -> dict:
    from kvchat.remote.metrics import parse

    return parse(httpx.get(server + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text)


def wait_server_idle(server, deadline_s=60) -> dict:
    """Until the server has no open request and holds no KV block (a deadline, not a speed test)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        m = metrics(server)
        if m["kvchat:requests_running"] == 0 and m["kvchat:kv_bytes_in_use"] == 0:
            return m
        time.sleep(0.1)
    raise AssertionError(f"server still busy: {m}")


def send(backend, messages, **sampling) -> Finished:
    return backend.submit(Request(messages=messages, sampling=SamplingParams(**{**GREEDY, **sampling}))).result(120)


def test_it_is_a_backend_and_lists_the_servers_models(backend):
    assert isinstance(backend, Backend)
    assert backend.models == [backend.model] and backend.model == "SmolLM2-135M-Instruct"


def test_what_a_server_owns_it_says_in_its_capabilities_and_refuses_in_a_future(backend):
    """The app asked hasattr(engine, "load_model") and "is there a server" in eleven places; a
    backend now says what it lets the caller do, and the whole protocol is there to call."""
    from kvchat.core.backend import LOCAL, SERVER
    from kvchat.engine.engine import Engine

    assert backend.capabilities == SERVER and Engine.capabilities == LOCAL
    for future in (backend.load_model(None), backend.reconfigure(max_context=1024), backend.forget(None),
                   backend.tokenize("Hi")):
        assert isinstance(future.exception(timeout=1), EngineError) and str(future.exception())


def test_it_announces_itself_and_stops_like_the_engine(backend):
    """What the app's bridge relies on: ModelReady replayed to a late listener, a request's listener,
    and stop through ``cancel(handle)``."""
    from kvchat.core.events import ModelReady

    seen, streamed = [], []
    backend.add_listener(seen.append, replay=True)
    ready = seen[0]
    assert isinstance(ready, ModelReady) and ready.settings["model"] == backend.model
    assert ready.settings["server"] == backend.base_url and ready.model_config is None
    handle = backend.submit(Request(messages=[{"role": "user", "content": "Tell me a long story."}],
                                    sampling=SamplingParams(max_new_tokens=500, **GREEDY)), listener=streamed.append)
    for event in handle:
        if isinstance(event, TokenDelta):
            assert event.token_id == -1  # a server's deltas carry no token id
            backend.cancel(handle).result(1)
        if isinstance(event, Finished):
            break
    assert event.finish_reason == "cancelled" and streamed[-1] is event and event.token_ids == []


def test_a_reply_streams_with_the_servers_stats(backend):
    handle = backend.submit(Request(messages=[{"role": "user", "content": "Name a fruit."}],
                                    sampling=SamplingParams(max_new_tokens=6, **GREEDY)))
    events = list(handle)
    done = events[-1]
    assert isinstance(done, Finished) and done.finish_reason == "length"
    assert "".join(e.text for e in events if isinstance(e, TokenDelta)) == done.text and done.text
    s = done.stats
    assert s.generated_tokens == 6 and s.prompt_tokens > 0 and s.cached_reported and s.ttft_ms > 0


def test_stop_closes_the_stream_and_the_server_cancels(backend, server):
    before = wait_server_idle(server)["kvchat:requests_cancelled_total"]
    handle = backend.submit(Request(messages=[{"role": "user", "content": "Tell me a very long story."}],
                                    sampling=SamplingParams(max_new_tokens=1000, **GREEDY)))
    deltas = 0
    for event in handle:
        if isinstance(event, TokenDelta):
            deltas += 1
            if deltas == 2:
                handle.cancel()
        if isinstance(event, Finished):
            break
    assert event.finish_reason == "cancelled" and event.stats.generated_tokens < 1000
    assert wait_server_idle(server)["kvchat:requests_cancelled_total"] == before + 1


def test_stop_while_the_server_is_still_prefilling(backend, server):
    before = wait_server_idle(server)["kvchat:requests_cancelled_total"]
    handle = backend.submit(Request(messages=[{"role": "user", "content": "word " * 1200}],
                                    sampling=SamplingParams(max_new_tokens=400, **GREEDY)))
    end = time.monotonic() + 60  # until the server runs it: on the wire, and no byte of the reply yet
    while metrics(server)["kvchat:requests_running"] == 0 and time.monotonic() < end:
        time.sleep(0.02)
    handle.cancel()
    assert handle.result(30).finish_reason == "cancelled"
    assert wait_server_idle(server)["kvchat:requests_cancelled_total"] == before + 1


def test_regenerate_and_edit_hit_the_servers_cache(backend):
    history = [{"role": "user", "content": "What is the capital of France?"},
               {"role": "assistant", "content": "The capital of France is Paris."},
               {"role": "user", "content": "And what is the capital of Italy?"}]
    first = send(backend, history, max_new_tokens=8)
    again = send(backend, history, max_new_tokens=8)  # regenerate: the same messages
    assert again.text == first.text
    assert again.stats.cached_tokens >= first.stats.prompt_tokens - 16
    edited = send(backend, history[:2] + [{"role": "user", "content": "And of Spain?"}], max_new_tokens=8)
    assert edited.stats.cached_tokens >= 16 and edited.stats.cached_tokens < edited.stats.prompt_tokens


def test_a_second_conversation_with_the_same_persona_is_cached_on_the_server(backend):
    persona = {"role": "system", "content": PERSONA}
    cold = send(backend, [persona, {"role": "user", "content": "What is 2 + 2?"}], max_new_tokens=2)
    warm = send(backend, [persona, {"role": "user", "content": "And what is a prime number?"}], max_new_tokens=2)
    assert cold.stats.prompt_tokens > 500 and warm.stats.cached_reported
    assert warm.stats.cached_tokens >= 490
    print(f"persona: {warm.stats.cached_tokens} of {warm.stats.prompt_tokens} cached, TTFT warm/cold "
          f"{warm.stats.ttft_ms:.0f}/{cold.stats.ttft_ms:.0f} ms = {warm.stats.ttft_ms / cold.stats.ttft_ms:.2f}")


def test_the_terminal_chat_runs_on_the_remote(backend):
    from kvchat.cli.chat_session import ChatSession

    session, said = ChatSession(backend, system="You are terse."), []
    sampling = SamplingParams(max_new_tokens=4, **GREEDY)
    for text in ("Hi!", "How are you?"):
        session.send(text, sampling, lambda handle: handle.result(60), said.append)
    assert not said and len(session.messages) == 4
    assert session.last_stats.cached_tokens > 0 and "cached" in session.stats_line()


def test_the_servers_memory_comes_from_its_metrics(backend):
    end = time.monotonic() + 30
    while backend.last_memory is None and time.monotonic() < end:
        time.sleep(0.1)
    memory = backend.last_memory
    assert memory.server == "kvchat" and 0 <= memory.kv_usage <= 1 and memory.prefix_hit_rate is not None


def test_a_wrong_key_is_a_clear_error(server):
    b = RemoteBackend(server, api_key="wrong", metrics_period=None)
    with pytest.raises(EngineError, match="401"):
        b.wait_ready(30)
    assert isinstance(b.submit(Request(messages=[{"role": "user", "content": "Hi"}])).events.get(timeout=5).message, str)


def test_generate_json_on_the_remote_is_the_local_document(server):
    out = subprocess.run([sys.executable, "-m", "kvchat.cli.main", "generate", "--remote", server, "--prompt", "Hi",
                          "--max-new-tokens", "3", "--temperature", "0", "--json"],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "KVCHAT_REMOTE_API_KEY": KEY})
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert set(doc) == {"text", "token_ids", "finish_reason", "stats"}
    assert doc["stats"]["generated_tokens"] == 3 and doc["stats"]["cached_reported"] is True


# -- without a server --

def test_api_root():
    assert api_root("http://h:8000") == api_root("http://h:8000/v1/") == "http://h:8000/v1"
    assert api_root("localhost:8080") == "http://localhost:8080/v1"
    # an endpoint pasted with the root (a client's config often holds the whole URL)
    assert api_root("http://gpu-box:8000/v1/chat/completions") == "http://gpu-box:8000/v1"
    assert api_root("gpu-box:8000/v1/models/") == "http://gpu-box:8000/v1"


VLLM = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 750.0
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""
SGLANG = 'sglang:token_usage{model_name="m"} 0.5\nsglang:cache_hit_rate{model_name="m"} 0.4\n'
LLAMA = "# HELP llamacpp:kv_cache_usage_ratio KV-cache usage.\nllamacpp:kv_cache_usage_ratio 0.125\n"
# today's llama-server --metrics (its /metrics handler): no KV usage, requests processing and deferred
# (prompt tokens computed, and apart those reused from its cache: 3,114 of 10,000 in all)
LLAMA_NOW = ("llamacpp:prompt_tokens_total 6886\nllamacpp:prompt_tokens_cached_total 3114\n"
             "llamacpp:tokens_predicted_total 3469\nllamacpp:n_decode_total 40\n"
             "llamacpp:requests_processing 1\nllamacpp:requests_deferred 2\n")
VLLM_EARLY_V1 = ('vllm:gpu_cache_usage_perc{engine="0"} 0.5\nvllm:gpu_prefix_cache_queries_total{engine="0"} 200.0\n'
                 'vllm:gpu_prefix_cache_hits_total{engine="0"} 50.0\nvllm:num_requests_waiting{engine="0"} 4.0\n')


@pytest.mark.parametrize("text, server, usage, rate", [(VLLM, "vllm", 0.25, 0.75), (SGLANG, "sglang", 0.5, 0.4),
                                                        (LLAMA, "llama.cpp", 0.125, None),
                                                        (LLAMA_NOW, "llama.cpp", None, 0.3114),
                                                        (VLLM_EARLY_V1, "vllm", 0.5, 0.25), ("", None, None, None)])
def test_server_metrics_of_each_kind(text, server, usage, rate):
    memory = server_memory(text)
    assert (memory.server, memory.kv_usage, memory.prefix_hit_rate) == (server, usage, rate)


def test_server_metrics_in_one_line_for_the_terminal():
    assert server_memory(LLAMA_NOW).line() == "server (llama.cpp): KV not reported, prefix hits 31%, " \
                                              "1 running, 2 waiting"
    assert server_memory(VLLM_EARLY_V1).line() == "server (vllm): KV 50% used, prefix hits 25%, 4 waiting"
    assert server_memory("").line() == "server metrics: not reported (no /metrics)"


def test_stats_in_the_terminal_chat_show_the_servers_figures(backend):
    from kvchat.cli.chat_session import ChatSession

    session = ChatSession(backend)
    end = time.monotonic() + 30
    while session.server_memory is None and time.monotonic() < end:  # the first poll (every 0.2 s here)
        time.sleep(0.05)
    session.send("Hi", SamplingParams(max_new_tokens=2, **GREEDY), lambda h: h.result(120), print)
    lines = session.stats_line().splitlines()
    assert lines[0].startswith("prompt ") and lines[1].startswith("[server (kvchat): KV ") and "prefix hits" in lines[1]


def test_connections_keep_the_key_in_the_keyring_only(tmp_path):
    from kvchat.core.connections import Connection, Connections, get_key

    before = keyring.get_keyring()
    ring = MemoryKeyring()
    keyring.set_keyring(ring)
    try:
        store = Connections(tmp_path / "connections.json")
        store.save(Connection("lab", "http://gpu-box:8000", "llama-70b"), api_key="s3cret")
        store.save(Connection("home", "http://127.0.0.1:8080"))
        assert [c.name for c in store.all()] == ["lab", "home"] and store.get("lab").model == "llama-70b"
        assert "s3cret" not in (tmp_path / "connections.json").read_text()
        assert get_key("lab") == "s3cret" and get_key("home") is None
        store.remove("lab")
        assert get_key("lab") is None and [c.name for c in store.all()] == ["home"]
    finally:
        keyring.set_keyring(before)


def test_without_a_keyring_saving_a_key_says_so_and_writes_nothing(tmp_path):
    from keyring.backends.fail import Keyring as NoKeyring

    from kvchat.core.connections import Connection, Connections, KeyringUnavailable, get_key

    before = keyring.get_keyring()
    keyring.set_keyring(NoKeyring())
    try:
        store = Connections(tmp_path / "connections.json")
        with pytest.raises(KeyringUnavailable, match="--api-key"):
            store.save(Connection("lab", "http://gpu-box:8000"), api_key="s3cret")
        assert store.all() == [] and get_key("lab") is None
    finally:
        keyring.set_keyring(before)


# -- llama.cpp's server, when one is installed --

@pytest.mark.skipif(shutil.which("llama-server") is None, reason="llama-server is not on PATH")
def test_llama_server_as_the_remote(tmp_path):
    from kvchat.core.model_source import starter_path

    port = free_port()
    proc = subprocess.Popen(["llama-server", "-m", str(starter_path()), "--port", str(port), "--metrics", "-c", "2048"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", proc)
        b = RemoteBackend(f"http://127.0.0.1:{port}", metrics_period=0.2)
        b.wait_ready(30)
        persona = {"role": "system", "content": PERSONA}
        send(b, [persona, {"role": "user", "content": "What is 2 + 2?"}], max_new_tokens=2)
        warm = send(b, [persona, {"role": "user", "content": "What is a prime?"}], max_new_tokens=2)
        assert warm.text and warm.stats.cached_reported and warm.stats.cached_tokens >= 400
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_connection_saved_with_a_one_model_servers_old_model_id_still_connects(server):
    """kvchat serve's id was "starter (SmolLM2-135M-Instruct)" before it became one word: a
    connection saved then named a model the server no longer lists."""
    b = RemoteBackend(server, api_key=KEY, model="starter (SmolLM2-135M-Instruct)", metrics_period=None)
    try:
        b.wait_ready(30)
        assert b.model == "SmolLM2-135M-Instruct"
    finally:
        b.close()
