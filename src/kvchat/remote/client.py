"""The remote backend: an OpenAI-compatible server (vLLM, SGLang, llama-server, Ollama, another
kvchat) behind the same submit / cancel / events as the local Engine.

Each request streams on its own thread and its own connection. Stop must reach the server even
while it is still prefilling (no byte of the response yet): the connection's socket is kept and
shut down on cancel, which wakes the blocked read and sends the server a FIN at once; closing a
socket that another thread reads from does neither on Linux."""
import json
import logging
import socket
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpcore
import httpx
from httpx_sse import connect_sse

from kvchat.core.backend import SERVER
from kvchat.core.connections import server_url
from kvchat.core.events import EngineError, Error, Finished, LoadFailed, ModelReady, Request, RequestHandle, Stats, TokenDelta
from kvchat.remote.metrics import ServerMemory, server_memory

log = logging.getLogger("kvchat.remote")
METRICS_PERIOD = 2.0
CONNECT_S, READ_S = 10.0, 600.0  # a busy server may queue a request for minutes before its first byte


@dataclass
class RemoteStats(Stats):
    """Stats of a remote reply: TTFT and tok/s measured here, token counts as the server gave them."""
    cached_reported: bool = False  # False: the server did not say how much of the prompt it had cached


def api_root(url: str) -> str:
    """'http://host:8000', 'host:8000/v1/' or 'http://host:8000/v1/chat/completions' ->
    'http://host:8000/v1'."""
    url = server_url(url)
    return url if url.endswith("/v1") else url + "/v1"


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def server_error(response: httpx.Response) -> str:
    """One line from an error response: OpenAI's error.message, FastAPI's detail, or the text."""
    try:
        body = json.loads(response.read() or b"{}")
    except ValueError:
        body = {}
    detail = body.get("error") if isinstance(body, dict) else None
    message = (detail.get("message") if isinstance(detail, dict) else detail) or (
        body.get("detail") if isinstance(body, dict) else None) or response.text[:200]
    return f"the server answered {response.status_code}: {message}"


def list_models(base_url: str, api_key: str | None = None, timeout: float = CONNECT_S) -> list[str]:
    """The model ids the server offers (its /v1/models)."""
    try:
        r = httpx.get(api_root(base_url) + "/models", headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as e:
        raise EngineError(f"cannot reach {base_url}: {e}") from None
    if r.status_code != 200:
        raise EngineError(server_error(r))
    try:
        return [m["id"] for m in r.json()["data"]]
    except (ValueError, KeyError, TypeError):
        raise EngineError(f"{base_url} did not answer /v1/models as an OpenAI-compatible server") from None


class _Sockets(httpcore.SyncBackend):
    """httpcore's own network backend, keeping what it connects so that a cancel can shut it."""

    def __init__(self):
        super().__init__()
        self.streams = []

    def connect_tcp(self, *args, **kwargs):
        stream = super().connect_tcp(*args, **kwargs)
        self.streams.append(stream)
        return stream

    def shut(self) -> None:
        for stream in self.streams:
            try:
                stream.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass


class RemoteHandle(RequestHandle):
    def __init__(self, request: Request, listener=None):
        super().__init__(request, listener)
        self.sockets = _Sockets()

    def cancel(self) -> None:
        super().cancel()
        self.sockets.shut()


def _put(handle: RequestHandle, event) -> None:
    # the engine's handle may deliver through put() (which also resolves its future); older ones
    # only have the queue
    getattr(handle, "put", handle.events.put)(event)


class RemoteBackend:
    """A connection: base URL, optional API key, and a model from the server's /v1/models (the first
    one when none is named). ``ready`` / ``load_error`` / ``wait_ready`` behave as the Engine's."""
    kind = "remote"
    capabilities = SERVER

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 metrics_period: float | None = METRICS_PERIOD):
        self.base_url, self.api_key, self.model = api_root(base_url), api_key, model
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.models: list[str] = []
        self.last_memory: ServerMemory | None = None
        self._listeners: list = []
        self._lock = threading.Lock()  # orders a listener's replay against the announcement
        self._status: ModelReady | LoadFailed | None = None
        self._closed = threading.Event()
        self._metrics_period = metrics_period
        self._thread = threading.Thread(target=self._main, name="kvchat-remote", daemon=True)
        self._thread.start()

    # -- the Backend interface --

    @property
    def label(self) -> str:
        return f"{self.model} at {self.base_url}"

    @property
    def alive(self) -> bool:
        return not self._closed.is_set()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise EngineError(f"{self.base_url} has not answered yet")
        if self.load_error:
            raise EngineError(self.load_error)

    def add_listener(self, callback, replay: bool = False) -> None:
        """``callback(event)`` with ModelReady or LoadFailed once the server has answered, then
        ServerMemory about every two seconds (once, all None, when the server has no /metrics),
        from a background thread: hand it on, as with the Engine. With ``replay``, a listener that
        comes after the server answered gets that answer at once."""
        with self._lock:
            self._listeners.append(callback)
            status = self._status if replay else None
        if status is not None:
            callback(status)

    def cancel(self, handle: RequestHandle) -> Future:
        """Stop a request: its connection is shut at once; the future is done already."""
        handle.cancel()
        done: Future = Future()
        done.set_result(None)
        return done

    def persona_state(self, system_prompt: str) -> str:
        """The server keeps its own prefix cache; kvchat cannot look into it, only send the persona
        byte-identical so that it hits."""
        return "server"

    def settings(self) -> dict:
        """What the app shows for a connection, in the Engine's settings' keys where they apply."""
        return {"model": self.model, "server": self.base_url, "host": urlsplit(self.base_url).netloc,
                "kv_precision": "server", "precision": None}

    def cancel_load(self) -> None:
        pass  # nothing is loaded here

    # what the server owns: asked of a connection, each is refused in its future (``capabilities``)

    def load_model(self, config=None) -> Future:
        return _refused(f"{self.base_url} serves its own model; choose another connection or this computer")

    def reconfigure(self, max_context=None, kv_precision=None, headroom_bytes=None) -> Future:
        return _refused(f"the context and the KV cache of {self.base_url} are the server's to set")

    def forget(self, messages=None) -> Future:
        return _refused(f"{self.base_url} keeps its own cache")

    def tokenize(self, text: str) -> Future:
        return _refused(f"the tokenizer of {self.base_url} is not reachable from here")

    def close(self) -> None:
        self._closed.set()

    def submit(self, request: Request, listener=None) -> RequestHandle:
        """``listener(event)``, when given, sees the request's events on its streaming thread."""
        handle = RemoteHandle(request, listener)
        if self.load_error or not self.ready.is_set():
            _put(handle, Error(self.load_error or f"{self.base_url} is not connected yet"))
        elif request.messages is None:
            _put(handle, Error("a remote server takes messages, not token ids"))
        else:
            threading.Thread(target=self._run, args=(handle,), name="kvchat-remote-request", daemon=True).start()
        return handle

    # -- connecting and the server's metrics --

    def _main(self) -> None:
        try:
            self.models = list_models(self.base_url, self.api_key)
            if not self.models:
                raise EngineError(f"{self.base_url} offers no model")
            if self.model is None:
                self.model = self.models[0]
            elif self.model not in self.models and len(self.models) == 1:
                # a one-model server renamed its model (kvchat serve's id was "starter (...)" before
                # 2026-12-08; llama-server names its file): the connection still means that model
                self.model = self.models[0]
            elif self.model not in self.models:
                raise EngineError(f"{self.base_url} has no model {self.model!r}; it offers {', '.join(self.models)}")
        except EngineError as e:
            self.load_error = str(e)
        self.ready.set()
        self._announce(LoadFailed(self.load_error) if self.load_error else
                       ModelReady(self.label, self.settings(), None))
        if self.load_error or not self._metrics_period:
            return
        while not self._closed.is_set():
            memory = self._read_metrics()
            if memory is not None:
                self.last_memory = memory
                self._emit(memory)
            if memory is None or memory.server is None:
                return  # nothing to poll
            self._closed.wait(self._metrics_period)

    def _announce(self, status) -> None:
        with self._lock:
            self._status = status
            listeners = list(self._listeners)
        self._emit(status, listeners)

    def _read_metrics(self) -> ServerMemory | None:
        root = self.base_url[:-len("/v1")]
        try:
            r = httpx.get(root + "/metrics", headers=_headers(self.api_key), timeout=CONNECT_S)
        except httpx.HTTPError:
            return ServerMemory(server=None)
        return server_memory(r.text) if r.status_code == 200 else ServerMemory(server=None)

    def _emit(self, event, listeners: list | None = None) -> None:
        for callback in list(self._listeners) if listeners is None else listeners:
            try:
                callback(event)
            except Exception:
                log.exception("a backend listener failed")

    # -- one request --

    def body(self, request: Request) -> dict:
        """Messages as role and content only: the system prompt goes out byte-identical every time,
        so the server's own prefix cache hits on it. Sampling fields beyond OpenAI's are sent only
        when set (vLLM, SGLang and llama-server read them; OpenAI's own API would refuse them)."""
        sp = request.sampling
        body = {"model": self.model, "stream": True, "stream_options": {"include_usage": True},
                "messages": [{"role": m["role"], "content": m["content"]} for m in request.messages],
                "max_tokens": sp.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p}
        extras = {"top_k": sp.top_k or None, "min_p": sp.min_p or None, "seed": sp.seed,
                  "repetition_penalty": None if sp.repetition_penalty == 1 else sp.repetition_penalty,
                  "stop": sp.stop or None}
        body.update({k: v for k, v in extras.items() if v is not None})
        return body

    def _run(self, handle: RemoteHandle) -> None:
        stats, text = RemoteStats(kv_precision="server"), []
        state = {"start": time.perf_counter(), "first": None, "finish": "length", "deltas": 0}
        transport = httpx.HTTPTransport(retries=0)
        try:
            transport._pool._network_backend = handle.sockets  # httpcore 1.x; see the module's note
        except AttributeError:
            pass
        try:
            with httpx.Client(transport=transport, headers=_headers(self.api_key),
                              timeout=httpx.Timeout(READ_S, connect=CONNECT_S)) as client:
                with connect_sse(client, "POST", self.base_url + "/chat/completions",
                                 json=self.body(handle.request)) as source:
                    if source.response.status_code != 200:
                        raise EngineError(server_error(source.response))
                    for sse in source.iter_sse():  # SSEError (an httpx error) if it is not text/event-stream
                        if handle.cancelled or self._read_event(sse.data, handle, stats, text, state):
                            break
        except EngineError as e:
            if not handle.cancelled:
                return _put(handle, Error(str(e)))
        except (httpx.HTTPError, OSError, ValueError) as e:  # ValueError: a stream that is not JSON
            if not handle.cancelled:
                return _put(handle, Error(f"{self.base_url}: {type(e).__name__}: {e}"))
        finally:
            handle.sockets.shut()
        _put(handle, self._finished(handle, stats, text, state))

    def _read_event(self, data: str, handle, stats: RemoteStats, text: list, state: dict) -> bool:
        """One server-sent event's data (httpx-sse splits the stream on CR and LF only, as the SSE
        spec says; httpx's iter_lines also splits on U+2028 and U+0085, which vLLM and llama-server
        send raw inside a token); True at the end of the stream."""
        if data == "[DONE]":
            return True
        if not data:  # an event of other fields only (retry:, id:)
            return False
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ValueError("a chunk that is not a JSON object")
        if "error" in chunk:
            error = chunk["error"]
            raise EngineError(f"the server failed mid-reply: {error.get('message') if isinstance(error, dict) else error}")
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if delta:
                if state["first"] is None:
                    state["first"] = time.perf_counter()
                state["deltas"] += 1
                text.append(delta)
                _put(handle, TokenDelta(delta, -1))
            if choice.get("finish_reason"):
                state["finish"] = "length" if choice["finish_reason"] == "length" else "stop"
        self._read_usage(chunk, stats)
        return False

    @staticmethod
    def _read_usage(chunk: dict, stats: RemoteStats) -> None:
        usage = chunk.get("usage") or {}
        if usage:
            stats.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            stats.generated_tokens = int(usage.get("completion_tokens") or 0)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            if cached is not None:
                stats.cached_tokens, stats.cached_reported = int(cached), True
        timings = chunk.get("timings") or {}  # llama-server: cache_n tokens reused, prompt_n computed
        if "cache_n" in timings and not stats.cached_reported:
            stats.cached_tokens, stats.cached_reported = int(timings["cache_n"]), True
            if not stats.prompt_tokens:
                stats.prompt_tokens = int(timings["cache_n"]) + int(timings.get("prompt_n") or 0)

    @staticmethod
    def _finished(handle, stats: RemoteStats, text: list, state: dict) -> Finished:
        end, first = time.perf_counter(), state["first"]
        stats.generated_tokens = stats.generated_tokens or state["deltas"]
        if first is not None:
            stats.ttft_ms = (first - state["start"]) * 1000
            if stats.generated_tokens > 1 and end > first:
                stats.decode_tok_s = (stats.generated_tokens - 1) / (end - first)
        reason = "cancelled" if handle.cancelled else state["finish"]
        return Finished("".join(text), [], reason, stats)


def _refused(reason: str) -> Future:
    future = Future()
    future.set_exception(EngineError(reason))
    return future
