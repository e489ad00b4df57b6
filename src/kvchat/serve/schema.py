"""The local API's request bodies: what is accepted, what is refused with a clear 400, and how an
accepted body becomes the engine's Request. Every refusal raises ApiError, never a bare exception,
so that no input can turn into a 500."""
import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvchat.core.config import MAX_MESSAGES, ConfigError, SamplingParams

MAX_BODY_BYTES = 8 << 20
MAX_STOPS, MAX_STOP_CHARS = 16, 128  # every stop string is matched against every token's text
PENALTY_RANGE = (0.01, 100.0)  # outside it a seen token's logit overflows or vanishes
SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed takes
# a prediction past what the reply can use is cut before the engine tokenizes it: no token of the
# tokenizers kvchat runs is this long, so every token the reply could keep stays
PREDICTION_CHARS_PER_TOKEN = 32


class ApiError(Exception):
    """``close``: refused before its body was read; the connection ends rather than read it."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 close: bool = False, retry_after: int | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.close = message, status, param, code, close
        self.retry_after = retry_after  # seconds, for a client's backoff (429)


def _utf8(value: str, where: str) -> str:
    """A lone surrogate (JSON allows "\\ud800") cannot be tokenized; say so before the engine tries."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where} is not valid Unicode (a lone surrogate)") from None
    return value


def _text_parts(content, where: str):
    """The texts of ``content`` (a string or text parts), checked as Unicode."""
    for text in [content] if isinstance(content, str) else [p.text for p in content or [] if p.text]:
        _utf8(text, where)
    return content


def _joined(content, sep: str, param: str) -> str:
    """``content`` as one text: its text parts joined with ``sep``; another kind of part refused."""
    if isinstance(content, str):
        return content
    other = [p.type for p in content if p.type != "text" or p.text is None]
    if other:
        raise ApiError(f"{param if param != 'messages' else 'content'}: only text parts are supported, "
                       f"not {other[0]!r}", param=param)
    return sep.join(p.text for p in content)


class Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[Part] | None

    @field_validator("content")
    @classmethod
    def unicode(cls, v):
        return _text_parts(v, "content")

    def plain(self) -> dict:
        """The engine's message: developer is system (OpenAI's newer name for it); text parts joined
        with newlines, as vLLM joins them, so a persona sent either way is the same bytes."""
        if self.content is None:
            raise ApiError("content: null content (tool calls) is not supported", param="messages")
        text = _joined(self.content, "\n", "messages")
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: the text the reply is expected to be, e.g. the file being edited."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["content"]
    content: str | list[Part]

    @field_validator("content")
    @classmethod
    def unicode(cls, v):
        return _text_parts(v, "prediction")

    def text(self, max_tokens: int) -> str:
        return _joined(self.content, "", "prediction")[:max_tokens * PREDICTION_CHARS_PER_TOKEN]


class Sampling(BaseModel):
    """The fields both endpoints share. Fields kvchat cannot honour are declared so that a request
    using them is refused, not silently served without them."""
    model_config = ConfigDict(extra="ignore")
    model: Any = None
    stream: bool = False
    stream_options: dict | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    best_of: int | None = None
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the model says (benchmarks)
    prediction: Prediction | None = None

    @field_validator("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                     "frequency_penalty")
    @classmethod
    def finite(cls, v):
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("stop")
    @classmethod
    def bounded_stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        for s in stops:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string is at most {MAX_STOP_CHARS} characters")
            _utf8(s, "stop")
        return stops

    def refuse_unsupported(self) -> None:
        if self.n not in (None, 1):
            raise ApiError("n: only n = 1 is supported", param="n")
        if self.best_of not in (None, 1):
            raise ApiError("best_of: only best_of = 1 is supported", param="best_of")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise ApiError("logprobs: log probabilities are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise ApiError(f"{name}: not supported; use repetition_penalty", param=name)
        if self.logit_bias:
            raise ApiError("logit_bias: not supported", param="logit_bias")

    def sampling(self, default_max: int) -> SamplingParams:
        # a temperature below core.config.GREEDY_BELOW is greedy, a tiny top_p keeps the top token: both in the sampler
        temperature = 0.7 if self.temperature is None else self.temperature
        top_p = 1.0 if self.top_p is None else self.top_p
        penalty = 1.0 if self.repetition_penalty is None else self.repetition_penalty
        if not PENALTY_RANGE[0] <= penalty <= PENALTY_RANGE[1]:
            raise ApiError(f"repetition_penalty must be in [{PENALTY_RANGE[0]}, {PENALTY_RANGE[1]:.0f}]",
                           param="repetition_penalty")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ApiError("seed must be in [-2**63, 2**64)", param="seed")
        top_k = 0 if self.top_k in (None, -1) else self.top_k  # -1: off, as in vLLM
        try:
            return SamplingParams(
                max_new_tokens=default_max if self.max_tokens is None else self.max_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k,
                min_p=0.0 if self.min_p is None else self.min_p, repetition_penalty=penalty, seed=self.seed,
                stop=list(self.stop or []), ignore_eos=self.ignore_eos)
        except ConfigError as e:
            raise ApiError(str(e)) from None

    def prediction_text(self, sampling: SamplingParams) -> str | None:
        return self.prediction.text(sampling.max_new_tokens) if self.prediction is not None else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))


class ChatBody(Sampling):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    response_format: dict | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.tools or self.functions or self.tool_choice not in (None, "none") or self.function_call:
            raise ApiError("tools: tool and function calls are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError("response_format: only {\"type\": \"text\"} is supported", param="response_format")

    def sampling(self, default_max: int = 512) -> SamplingParams:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling(default_max)


class CompletionBody(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def unicode(cls, v):
        for text in [v] if isinstance(v, str) else [p for p in v if isinstance(p, str)]:
            _utf8(text, "prompt")
        return v

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise ApiError("echo: not supported", param="echo")
        if self.suffix:
            raise ApiError("suffix: not supported", param="suffix")

    def one_prompt(self) -> str | list[int]:
        """One text or one list of token ids; a batch of prompts is refused (n = 1 only)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ApiError("prompt: one prompt per request", param="prompt")
            p = p[0]
        if not p:
            raise ApiError("prompt: empty", param="prompt")
        return p


def parse(raw: bytes, kind: type[Sampling]) -> Sampling:
    """Bytes (at most MAX_BODY_BYTES: the server's read_body stops there) to a validated body.
    json.loads is asked to refuse NaN and Infinity (not JSON), and deep nesting, which would
    otherwise end in a RecursionError."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ApiError(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError("the body must be a JSON object")
    try:
        body = kind.model_validate(data)
    except ValidationError as e:
        raise ApiError(*_first_error(e)) from None
    except RecursionError:
        raise ApiError("the body is nested too deeply") from None
    body.refuse_unsupported()
    return body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _first_error(e: ValidationError) -> tuple[str, int, str | None]:
    first = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first.get("loc", ()))
    message = str(first.get("msg", "invalid request"))
    if message.startswith("Value error, "):
        message = message[len("Value error, "):]
    return f"{where or 'body'}: {message}", 400, where or None


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
