"""kvchat serve, driven by the official openai client and by raw bad requests."""
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.server import create_app

from tiny_models import as_loaded

PERSONA = "You are Ada, a patient tutor of mathematics. " * 50  # about 500 tokens


@pytest.fixture(scope="module")
def base_url(starter):
    engine = Engine(EngineConfig(max_context=1024), loaded=as_loaded(starter.model, starter.tokenizer, "starter"))
    engine.wait_ready()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "starter"), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(10)
    engine.close()


@pytest.fixture
def client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_models_lists_the_loaded_model(client):
    assert [m.id for m in client.models.list().data] == ["starter"]


def test_completion_not_streamed(client):
    r = client.chat.completions.create(model="starter", messages=[{"role": "user", "content": "Hi!"}],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_streamed_equals_not_streamed(client):
    kw = dict(model="starter", messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].usage.completion_tokens > 0


def test_second_conversation_with_the_same_persona_is_cached(client):
    def ask(question):
        return client.chat.completions.create(
            model="starter", max_tokens=2, temperature=0,
            messages=[{"role": "system", "content": PERSONA}, {"role": "user", "content": question}])

    first = ask("What is 2 + 2?")
    assert first.usage.prompt_tokens > 500
    second = ask("And what is a prime number?")
    assert second.usage.prompt_tokens_details.cached_tokens >= 496


@pytest.mark.parametrize("body, fragment", [
    (b"{not json", "JSON"),
    (b'{"messages": "hello"}', "messages"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "content"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', "role"),
    (b'{"messages": []}', "messages"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "max_new_tokens"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', "temperature"),
    (b'{"messages": [{"role": "user", "content": ""}]}', "empty"),
])
def test_bad_requests_get_4xx_with_an_openai_error_body(base_url, body, fragment):
    r = httpx.post(f"{base_url}/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and fragment.lower() in error["message"].lower()


def test_too_long_prompt_streamed_is_a_400_and_the_server_goes_on(client, base_url):
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="longer than the context"):
        client.chat.completions.create(model="starter", messages=[{"role": "user", "content": "go " * 2000}],
                                       stream=True)
    assert client.chat.completions.create(model="starter", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=1).usage.completion_tokens == 1
