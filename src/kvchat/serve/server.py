"""The local OpenAI-compatible API: /v1/chat/completions and /v1/completions (streamed or not),
/v1/models, /health and Prometheus /metrics.

Requests run together on the engine thread (up to its ``max_running``, the rest wait there); this
side only waits for their events, on the event loop, and watches the connection while it waits, so
a client that hangs up cancels its request at once, streamed or not, and frees its place.
``max_queue`` bounds the requests running and waiting: past it, 429."""
import asyncio
import queue
import time
import uuid

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response

from kvchat.core.events import (EngineError, Error, Finished, LoadFailed, LoadProgress, ModelReady, Notice, PrefillProgress,
                                Refused, Request, TokenDelta, replies_wait)
from kvchat.core.memory import MemorySnapshot
from kvchat.serve.guard import Guard
from kvchat.serve.schema import MAX_BODY_BYTES, ApiError, ChatBody, CompletionBody, error_body, parse
from kvchat.serve.stream import EventStream, chat_chunks, completion_chunks, finish_reason
from kvchat.serve.metrics import Counters, MetricsCollector
from kvchat.serve.transport import incident

BODY_IDLE_S = 15.0  # a body that stops arriving for this long is given up
BODY_DEADLINE_S = 60.0  # and one that takes longer than this in all (8 MiB at 140 KB/s)
RETRY_AFTER_S = 1  # a 429's Retry-After: a slot frees as soon as any request in the queue ends


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None,
                   code=None, close: bool = False, retry_after: int | None = None) -> JSONResponse:
    """``close``: the connection ends after it, so that a body left unread is not read after all."""
    headers = {"Connection": "close"} if close else {}
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    return JSONResponse(status_code=status, content=error_body(message, kind, param, code), headers=headers or None)


class ClientGone(Exception):
    """The client hung up before its body was all sent."""


def json_only(http: HttpRequest) -> None:
    """Only application/json: a web page can send text/plain, a form or multipart to any address
    without asking (no CORS preflight), and those bodies were parsed as JSON and served."""
    media = http.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(f"the body must be application/json, not {media or 'unlabelled'}", status=415,
                       code="unsupported_media_type", close=True)


def too_large() -> ApiError:
    return ApiError(f"the body is over {MAX_BODY_BYTES >> 20} MiB", status=413, close=True)


async def read_body(http: HttpRequest) -> bytes:
    """The body, refused past MAX_BODY_BYTES while it is read: on its Content-Length before a byte
    of it, a chunked one as it arrives (a 600 MiB body cost 800 MB when read whole first)."""
    length = http.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise ApiError("Content-Length is not a number", close=True)
        if int(length) > MAX_BODY_BYTES:
            raise too_large()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + BODY_DEADLINE_S
    chunks, size = [], 0
    while True:
        try:
            message = await asyncio.wait_for(http.receive(), min(BODY_IDLE_S, max(0.0, deadline - loop.time())))
        except asyncio.TimeoutError:
            incident("a request body arrived too slowly: answered 408 and closed")
            raise ApiError("the body arrived too slowly", status=408, code="timeout", close=True) from None
        if message["type"] == "http.disconnect":
            incident("a client hung up while sending its body")
            raise ClientGone()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise too_large()
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def engine_error_response(event: Error) -> JSONResponse:
    """A bad request is the caller's 400; an internal failure is our 500."""
    if event.internal:
        return error_response(500, event.message, "server_error")
    return error_response(400, event.message)


def usage(stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
        # OpenAI's: tokens proposed (a prediction's, or kvchat's own from the conversation) and kept or not
        "completion_tokens_details": {"reasoning_tokens": 0,
                                      "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                                      "rejected_prediction_tokens": stats.rejected_prediction_tokens},
        "kvchat": {"trimmed_messages": stats.trimmed_messages, "kv_precision": stats.kv_precision,
                   "ram_tokens": stats.ram_tokens, "disk_tokens": stats.disk_tokens,
                   "ttft_ms": round(stats.ttft_ms, 2), "decode_tok_s": round(stats.decode_tok_s, 2)},
    }


class EngineState:
    """What the engine last said about itself (its events, on its thread; plain assignments), so
    that /health and /metrics read no engine attribute."""

    def __init__(self):
        self.loading, self.error = True, None
        self.warming = False  # replies wait for the decode step's capture (CUDA)
        self.snapshot: MemorySnapshot | None = None

    def __call__(self, event) -> None:
        if isinstance(event, ModelReady):
            self.loading, self.error = False, None
        elif isinstance(event, LoadFailed):
            self.loading, self.error = False, None if event.restored else event.message
        elif isinstance(event, LoadProgress):
            self.loading = True
        elif isinstance(event, MemorySnapshot):
            self.snapshot = event
        elif isinstance(event, Notice):
            waits = replies_wait(event)
            self.warming = self.warming if waits is None else waits


class Waiter:
    """Wakes the event loop when the engine thread hands the request an event (the handle's
    listener runs there, after the event is queued) or when the client hangs up: a task waits for
    the server's http.disconnect, so a gone client is seen at once (polling the connection every
    100 ms took 50 ms on average to see it; polling the queue cost 8 clients their throughput)."""

    def __init__(self, http: HttpRequest):
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.gone = False
        self.watch = asyncio.ensure_future(self._watch(http.receive))

    async def _watch(self, receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        self.wake.set()

    def stop(self) -> None:
        """Before a streamed response takes the connection over (it listens for itself)."""
        self.watch.cancel()

    def listener(self, _event) -> None:
        self.loop.call_soon_threadsafe(self.wake.set)

    async def next_event(self, handle):
        """The request's next event, or None once the client has hung up (the request is then
        cancelled by whoever owns it)."""
        while True:
            self.wake.clear()
            if self.gone:
                return None
            try:
                return handle.events.get_nowait()
            except queue.Empty:
                pass
            await self.wake.wait()


def create_app(engine, model_name: str = "kvchat", *, api_key: str | None = None,
               host: str = "127.0.0.1", allow_hosts: tuple[str, ...] = (), cors_origins: tuple[str, ...] = (),
               max_queue: int = 32) -> FastAPI:
    """``engine``: the local Engine, used through its commands and events only."""
    app = FastAPI(title="kvchat", docs_url=None, redoc_url=None, openapi_url=None)
    counters = app.state.counters = Counters()
    state = EngineState()
    engine.add_listener(state, replay=True)

    @app.exception_handler(ApiError)
    async def refused(_request, exc: ApiError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, close=exc.close,
                              retry_after=exc.retry_after)

    @app.exception_handler(ClientGone)
    async def gone(_request, _exc):
        return Response(status_code=499, headers={"Connection": "close"})  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        return error_response(400, f"invalid request: {exc.errors()[:1]}")

    @app.exception_handler(Exception)
    async def bug(_request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.get("/health")
    def health():
        if state.error or not engine.alive:
            return error_response(503, state.error or "the engine has stopped", "server_error")
        if state.loading:
            return error_response(503, "the model is loading", "server_error")
        if state.warming:  # as vLLM's: healthy once a reply can start, its graphs captured
            return error_response(503, "warming up: capturing the decode step", "server_error")
        return {"status": "ok", "model": model_name, "requests": counters.active}

    model_card = {"id": model_name, "object": "model", "created": 0, "owned_by": "kvchat"}

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model_id:path}")
    def model(model_id: str):
        if model_id != model_name:
            raise ApiError(f"no model {model_id!r} here; this server has {model_name!r}", status=404,
                           param="model", code="model_not_found")
        return model_card

    registry = CollectorRegistry(auto_describe=False)
    registry.register(MetricsCollector(state, counters))

    @app.get("/metrics")
    def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    def admit() -> None:
        """The queue bound, checked before the body is read and again before it is tokenized."""
        if counters.active >= max_queue:
            counters.refused += 1
            raise ApiError(f"{counters.active} requests are already waiting; try again shortly", status=429,
                           code="rate_limit_exceeded", close=True, retry_after=RETRY_AFTER_S)

    async def accept(http: HttpRequest, kind, build):
        """The body, parsed, and the engine's Request that ``await build(body)`` makes of it, with a
        queue slot held from the parse on: ``run`` gives it back, or this does if building fails."""
        json_only(http)
        admit()
        body = parse(await read_body(http), kind)
        admit()
        counters.active += 1
        try:
            return body, await build(body)
        except BaseException:
            counters.active -= 1
            raise

    async def tokenized(text: str) -> list[int]:
        """On the engine thread, one prompt at a time, refused on its length in characters before
        it is tokenized when that suffices (eight 7.8 MiB prompts tokenized at once took 7.9 GB)."""
        try:
            return await asyncio.wrap_future(engine.tokenize(text))
        except Refused as e:  # no model, a switch, a shutdown
            raise ApiError(str(e), status=503, code="model_not_ready") from None
        except ValueError as e:  # ChatError: the prompt cannot fit
            raise ApiError(str(e), param="prompt") from None
        except EngineError as e:
            raise ApiError(str(e), status=500) from None

    async def run(http: HttpRequest, request: Request, stream: bool, reply, chunks):
        """Submit, then answer: a JSON body built by ``reply(finished)``, or an SSE stream of
        ``chunks(first_event, next_event)``. Errors before the first token keep their status code.
        The caller holds a queue slot (``accept``); this gives it back however the request ends."""
        waiter = Waiter(http)
        handle = engine.submit(request, listener=waiter.listener)
        closed = handed_over = ended = begun = False

        def close():
            nonlocal closed
            if not closed:
                closed = True
                if not ended:
                    counters.cancelled += 1
                handle.cancel()  # after the end a no-op; before it, the engine stops at its next step
                counters.active -= 1
                counters.running -= begun

        try:
            event = await waiter.next_event(handle)
            while event is not None and not isinstance(event, (TokenDelta, Finished, Error)):
                if isinstance(event, PrefillProgress) and not begun:  # the engine took it up
                    begun = True
                    counters.running += 1
                event = await waiter.next_event(handle)  # notices are not part of the reply
            if event is None:
                return Response(status_code=499)  # nobody is listening
            if isinstance(event, Error):
                ended = True
                return engine_error_response(event)
            if stream:
                async def events():
                    nonlocal event, ended
                    while event is not None:
                        yield event
                        if isinstance(event, (Finished, Error)):
                            ended = True
                            if isinstance(event, Finished):
                                counters.count(event)
                            return
                        event = await waiter.next_event(handle)

                handed_over = True  # the response closes it, however it ends
                waiter.stop()
                return EventStream(chunks(events()), close)
            while not isinstance(event, (Finished, Error)):
                event = await waiter.next_event(handle)
                if event is None:
                    return Response(status_code=499)
            ended = True
            if isinstance(event, Error):
                return engine_error_response(event)
            counters.count(event)
            return reply(event)
        finally:
            if not handed_over:
                waiter.stop()
                close()

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HttpRequest):
        async def build(body: ChatBody) -> Request:
            sampling = body.sampling()
            return Request(messages=[m.plain() for m in body.messages], sampling=sampling,
                           prediction=body.prediction_text(sampling))

        body, request = await accept(http, ChatBody, build)
        cid, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def reply(done: Finished) -> dict:
            return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": done.text},
                                 "logprobs": None, "finish_reason": finish_reason(done)}],
                    "usage": usage(done.stats)}

        return await run(http, request, body.stream, reply,
                         lambda events: chat_chunks(events, cid, created, model_name, body.include_usage, usage))

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        async def build(body: CompletionBody) -> Request:
            prompt, sampling = body.one_prompt(), body.sampling(16)
            if isinstance(prompt, str):
                prompt = await tokenized(prompt)
            return Request(prompt_ids=list(prompt), sampling=sampling, prediction=body.prediction_text(sampling))

        body, request = await accept(http, CompletionBody, build)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())

        def reply(done: Finished) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": done.text, "logprobs": None,
                                 "finish_reason": finish_reason(done)}],
                    "usage": usage(done.stats)}

        return await run(http, request, body.stream, reply,
                         lambda events: completion_chunks(events, cid, created, model_name, body.include_usage, usage))

    app.add_middleware(Guard, api_key=api_key, bound_host=host, allow_hosts=tuple(allow_hosts),
                       origins=tuple(cors_origins))
    if cors_origins:  # outermost, so that a browser's preflight (which carries no key) is answered
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    return app
