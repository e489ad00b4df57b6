"""Streams against awkward peers, with no model: ``kvchat serve`` on a scripted engine facing a
client that stops reading or hangs up before its first token, and the remote backend facing a server
whose events are framed in every way the SSE spec allows. Deadlines only stop a broken run."""
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import uvicorn

from kvchat.core.config import SamplingParams
from kvchat.core.events import Error, Finished, ModelReady, Request, RequestHandle, Stats, TokenDelta
from kvchat.remote.client import RemoteBackend
from kvchat.serve import transport
from kvchat.serve.server import create_app
from kvchat.serve.transport import server_config

from serve_process import free_port


class ScriptedEngine:
    """Runs one request at a time as the engine does: waits ``hold`` (a prefill) until cancelled,
    then puts ``tokens`` deltas as fast as it can, stopping at a cancel; ``cancelled`` lists the
    requests that saw one."""
    alive = True

    def __init__(self):
        self.hold, self.tokens = threading.Event(), 0
        self.hold.set()
        self.cancelled: list[RequestHandle] = []
        self.done = threading.Semaphore(0)

    def add_listener(self, callback, replay=False):
        callback(ModelReady("scripted", {}))

    def submit(self, request, listener=None):
        handle = RequestHandle(request, listener)
        threading.Thread(target=self._run, args=(handle,), daemon=True).start()
        return handle

    def _run(self, handle):
        while not self.hold.wait(0.01) and not handle.cancelled:
            pass
        n = 0
        while n < self.tokens and not handle.cancelled:
            handle.put(TokenDelta(" tok", n))
            n += 1
            if n % 100 == 0:  # about 100k a second at most: an endless reply's events stay few in memory
                time.sleep(0.001)
        if handle.cancelled:
            self.cancelled.append(handle)
        handle.put(Finished(" tok" * n, [], "cancelled" if handle.cancelled else "length",
                            Stats(prompt_tokens=3, generated_tokens=n)))
        self.done.release()


@pytest.fixture
def scripted(monkeypatch):
    monkeypatch.setattr(transport, "STALL_S", 0.5)
    engine = ScriptedEngine()
    port = free_port()
    app = create_app(engine, "scripted", max_queue=4)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield engine, port, app.state.counters
    server.should_exit = True
    thread.join(10)


def open_request(port: int, stream_it: bool, rcvbuf: int | None = None) -> socket.socket:
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 5, "stream": stream_it}).encode()
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return s


def until(condition, deadline_s=60):
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "the deadline of a broken run"
        time.sleep(0.01)


def test_a_streaming_client_that_stops_reading_is_dropped_and_its_slot_given_back(scripted):
    engine, port, counters = scripted
    # endless until the server drops it: a finite reply made fast on a busy machine was sometimes
    # all handed to the server, and so ended, before the 0.5 s stall that drops the client
    engine.tokens = 10**9
    reader = open_request(port, True, rcvbuf=4096)
    reader.recv(1)  # the reply has started; from here on nothing is read
    until(lambda: counters.active == 0)
    assert counters.cancelled == 1
    reader.close()
    engine.tokens = 3
    with socket.create_connection(("127.0.0.1", port)) as s:  # and the server serves on
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("stream_it", [True, False])
def test_a_client_that_hangs_up_before_its_first_token_cancels_it(scripted, stream_it):
    engine, port, counters = scripted
    engine.hold.clear()  # a prefill that lasts until the cancel
    engine.tokens = 10
    client = open_request(port, stream_it)
    until(lambda: counters.active == 1)
    client.close()
    until(lambda: engine.cancelled)
    until(lambda: counters.active == 0)
    assert counters.cancelled == 1 and counters.finished == 0


# -- the remote backend against a server that frames its events as the spec allows --

TOKENS = ["line\u2028sep", "next\x85line", " para\u2029graph", " done"]


def sse_body(framing: str) -> bytes:
    def chunk(choice: dict, **extra) -> dict:
        return {"id": "c", "object": "chat.completion.chunk", "choices": [choice] if choice else [], **extra}

    events = [chunk({"index": 0, "delta": {"role": "assistant", "content": ""}})]
    events += [chunk({"index": 0, "delta": {"content": t}}) for t in TOKENS]
    events += [chunk({"index": 0, "delta": {}, "finish_reason": "stop"}),
               chunk({}, usage={"prompt_tokens": 7, "completion_tokens": 4,
                                "prompt_tokens_details": {"cached_tokens": 5}})]
    sep = "\r\n" if framing == "crlf" else "\n"
    out = [f": a comment{sep}retry: 1000{sep}{sep}"]
    for e in events:
        text = json.dumps(e, ensure_ascii=False)  # raw UTF-8, as vLLM and llama-server send it
        if framing == "split":  # one event over two data lines, joined by a newline (valid JSON)
            half = text.index('"choices"')
            out.append(f"event: message{sep}id: 1{sep}data:{text[:half]}{sep}data: {text[half:]}{sep}{sep}")
        else:
            out.append(f"data: {text}{sep}{sep}")
    out.append(f"data: [DONE]{sep}{sep}")
    return "".join(out).encode()


class FakeOpenAI(BaseHTTPRequestHandler):
    framing = "lf"
    content_type = "text/event-stream"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._send(200, "application/json", json.dumps({"object": "list", "data": [{"id": "m"}]}).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        if self.content_type == "text/event-stream":
            self._send(200, self.content_type, sse_body(self.framing))
        else:
            self._send(200, self.content_type, b'{"choices": [{"message": {"content": "not streamed"}}]}')

    def _send(self, status: int, content_type: str, body: bytes):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def fake_server():
    def start(**attrs):
        handler = type("Handler", (FakeOpenAI,), attrs)
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    servers = []
    yield start
    for server in servers:
        server.shutdown()


def ask(url: str):
    backend = RemoteBackend(url, metrics_period=None)
    backend.wait_ready(30)
    handle = backend.submit(Request(messages=[{"role": "user", "content": "Hi"}], sampling=SamplingParams()))
    return list(handle)


@pytest.mark.parametrize("framing", ["lf", "crlf", "split"])
def test_the_remote_reads_every_framing_and_raw_line_separators_in_tokens(fake_server, framing):
    events = ask(fake_server(framing=framing))
    done = events[-1]
    assert isinstance(done, Finished), done
    assert [e.text for e in events if isinstance(e, TokenDelta)] == TOKENS
    assert done.text == "".join(TOKENS) and done.finish_reason == "stop"
    assert (done.stats.prompt_tokens, done.stats.cached_tokens, done.stats.generated_tokens) == (7, 5, 4)


def test_a_reply_that_is_not_an_event_stream_is_an_error_not_an_empty_reply(fake_server):
    events = ask(fake_server(content_type="application/json"))
    assert len(events) == 1 and isinstance(events[0], Error)
    assert "text/event-stream" in events[0].message
