"""The local OpenAI-compatible API: POST /v1/chat/completions (streamed or not), GET /v1/models."""
import json
import time
import uuid
from typing import Literal

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from .config import ConfigError, SamplingParams
from .engine import Engine
from .events import Error, Finished, Request, TokenDelta


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None

    def sampling(self) -> SamplingParams:
        max_new = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return SamplingParams(
            max_new_tokens=512 if max_new is None else max_new, temperature=self.temperature,
            top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
        )


def error_response(status: int, message: str, kind: str = "invalid_request_error", param=None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                               "param": param, "code": None}})


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
        "kvchat": {"trimmed_messages": stats.trimmed_messages, "kv_precision": stats.kv_precision},
    }


def create_app(engine: Engine, model_name: str = "kvchat") -> FastAPI:
    app = FastAPI(title="kvchat", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def invalid(_request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return error_response(400, f"{where or 'body'}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.get("/v1/models")
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "kvchat"}]}

    @app.post("/v1/chat/completions")
    def chat_completions(body: ChatCompletionRequest):
        try:
            sampling = body.sampling()
        except ConfigError as e:
            return error_response(400, str(e))
        handle = engine.submit(Request(messages=[m.model_dump() for m in body.messages], sampling=sampling))
        cid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if body.stream:
            first = handle.events.get()  # errors found before the first token still get a status code
            if isinstance(first, Error):
                return engine_error_response(first)
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_stream(handle, first, cid, model_name, include_usage),
                                     media_type="text/event-stream")
        for event in handle:
            if isinstance(event, Error):
                return engine_error_response(event)
            if isinstance(event, Finished):
                return {
                    "id": cid, "object": "chat.completion", "created": int(time.time()), "model": model_name,
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": event.text},
                                 "finish_reason": _reason(event.finish_reason)}],
                    "usage": usage(event.stats),
                }

    return app


def _reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def _stream(handle, first, cid: str, model_name: str, include_usage: bool):
    def chunk(delta: dict, finish=None, usage_=None, choices=True) -> str:
        payload = {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_name,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish}] if choices else []}
        if usage_ is not None:
            payload["usage"] = usage_
        return f"data: {json.dumps(payload)}\n\n"

    def events():
        yield first
        if not isinstance(first, (Finished, Error)):
            yield from handle

    try:
        yield chunk({"role": "assistant", "content": ""})
        for event in events():
            if isinstance(event, TokenDelta) and event.text:
                yield chunk({"content": event.text})
            elif isinstance(event, Finished):
                yield chunk({}, _reason(event.finish_reason))
                if include_usage:
                    yield chunk({}, usage_=usage(event.stats), choices=False)
            elif isinstance(event, Error):
                yield f"data: {json.dumps({'error': {'message': event.message, 'type': 'server_error'}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()  # a client that hung up stops the generation; after the end it is a no-op
