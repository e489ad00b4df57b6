"""Validated settings: the engine's, a request's sampling parameters, the KV precision."""
import os
from dataclasses import dataclass, field
from enum import Enum


class ConfigError(ValueError):
    """A setting or request that cannot be served; the message is shown to the user as is."""


class Precision(str, Enum):
    AUTO = "auto"  # the engine picks, and steps down under memory pressure
    FP16 = "fp16"  # the model's own dtype (fp32 on CPU)
    INT8 = "int8"
    FP8 = "fp8"  # e4m3, one scale per layer and KV head
    K8V4 = "k8v4"
    INT4 = "int4"


# Every precision, best quality first; each holds more tokens in the same bytes than the one before.
ORDER = (Precision.FP16, Precision.INT8, Precision.FP8, Precision.K8V4, Precision.INT4)
# What Auto steps down through and the planner tries in turn. fp8 is not a rung: on the starter, at
# context 4096 over five kinds of text, it costs -0.07% to +0.15% perplexity in half of fp16's
# bytes, where k8v4 costs -0.07% to +0.08% in 0.41 and int8 +-0.01% in 0.53 (docs/performance.md).
# As a rung it would serve only where int8 misses by under 6%, and there k8v4 answers as well in a
# fifth fewer bytes (and reads fewer on a GPU). Asked for by name, it is there.
LADDER = tuple(p for p in ORDER if p != Precision.FP8)
KV_MODES = [p.value for p in Precision if p != Precision.AUTO]  # the modes a bench or an eval runs in
KV_CHOICES = tuple(p.value for p in Precision)  # what a user may ask for: auto, then every precision
DEFAULT_CONTEXT = 8192  # tokens, when nothing else is asked
BLOCK_SIZE = 16  # tokens a KV block holds
DISK_CACHE_BYTES = 4 << 30  # the disk tier's default cap

GREEDY_BELOW = 1e-5  # as vLLM: a smaller temperature is greedy (dividing by it overflows the logits)

WEIGHTS = ("none", "auto", "bf16", "int8", "int4", "nf4")
DECODE_MODES = ("auto", "eager", "compiled")


# messages a request may carry: a long chat has a few hundred; 200,000 one-character messages (under
# the API's body limit) held the engine thread for minutes
MAX_MESSAGES = 2048
MAX_RUNNING = 16  # the largest batched decode step (engine/model/batch_step.py's last bucket)


@dataclass
class EngineConfig:
    model: str = "starter"
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    weights: str = "none"  # none | auto | bf16 | int8 | int4 (CPU: torch's packed kernels) | nf4 (CUDA)
    # auto | eager | compiled (inductor on the CPU, CUDA graphs on CUDA); KVCHAT_DECODE sets the
    # default, so a test suite of many short-lived engines need not compile each one
    decode: str = field(default_factory=lambda: os.environ.get("KVCHAT_DECODE", "auto"))
    kv_precision: Precision = Precision.FP16
    block_size: int = BLOCK_SIZE
    max_context: int = DEFAULT_CONTEXT
    kv_budget_bytes: int | None = None  # None: room for max_context tokens plus a prefix-cache reserve
    headroom_bytes: int = 1 << 30  # device memory left free for everything else
    prefill_chunk: int = 512
    max_running: int = 8  # requests decoding together, in one batched step; the rest wait
    threads: int | None = None
    allow_long_context: bool = False  # a context past the model's trained length (warned), else capped
    # the KV tiers under the pool: host RAM (None: a quarter of the RAM free at start; 0: off) and
    # disk, in kvchat's cache dir (0: off)
    ram_cache_bytes: int | None = None
    disk_cache_bytes: int = DISK_CACHE_BYTES
    # tokens proposed from the conversation (and an API client's prediction), checked several at
    # a time in one forward pass (engine/lookup.py); off: one token a step
    speculate: bool = True

    def __post_init__(self):
        try:
            self.kv_precision = Precision(self.kv_precision)
        except ValueError:
            raise ConfigError(f"kv_precision must be one of {', '.join(p.value for p in Precision)}, "
                              f"not {self.kv_precision!r}") from None
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, not {self.weights!r}")
        if self.decode not in DECODE_MODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODE_MODES)}, not {self.decode!r}")
        for name in ("block_size", "max_context", "prefill_chunk"):
            if int(getattr(self, name)) <= 0:
                raise ConfigError(f"{name} must be positive")
        if not isinstance(self.max_running, int) or not 1 <= self.max_running <= MAX_RUNNING:
            raise ConfigError(f"max_running must be an integer from 1 to {MAX_RUNNING}, not {self.max_running!r}")
        for name in ("ram_cache_bytes", "disk_cache_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ConfigError(f"{name} must be a number of bytes >= 0, not {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ConfigError(f"threads must be a positive integer, not {self.threads!r}")


@dataclass
class SamplingParams:
    max_new_tokens: int = 512
    temperature: float = 0.7
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # benchmarks: always generate max_new_tokens
    # check tokens proposed from the conversation several at a time where the engine allows it
    # (EngineConfig.speculate): the same reply, only sooner
    speculate: bool = True

    def __post_init__(self):
        checks = [
            (isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0,
             "max_new_tokens must be a positive integer"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k must be an integer >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p < 1, "min_p must be in [0, 1)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        if self.seed is not None:
            if not isinstance(self.seed, int) or isinstance(self.seed, bool):
                raise ConfigError("seed must be an integer")
            self.seed %= 2 ** 64  # torch takes seeds in [0, 2**64); any integer names one
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


MODEL_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")


# Gemma3TextConfig's values for what a config.json leaves out: a multimodal Gemma 3's (4B and up)
# text_config names only what differs from them (gemma-3-4b-it's: sizes, layers, window, RoPE)
GEMMA3_TEXT_DEFAULTS = {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2304,
                        "intermediate_size": 9216, "num_hidden_layers": 26, "num_attention_heads": 8,
                        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 4096,
                        "max_position_embeddings": 131072, "tie_word_embeddings": True}


def text_config(config):
    """The language model's part of a config, a config.json dict or a transformers config: a
    multimodal Gemma 3's ``text_config`` (the one such model the loader runs, its text part alone),
    else the config itself, so another wrapper is refused by its own name."""
    if not isinstance(config, dict):
        return getattr(config, "text_config", None) or config
    text = config.get("text_config")
    return {**GEMMA3_TEXT_DEFAULTS, **text} if config.get("model_type") == "gemma3" and isinstance(text, dict) \
        else config


def check_model_config(config, where: str, supported: tuple[str, ...]) -> None:
    """A model config (a config.json dict or a transformers config) that the planner can use, or
    ConfigError saying in one line what is wrong with it."""
    config = text_config(config)
    if not isinstance(config, dict):
        config = config.to_dict() if hasattr(config, "to_dict") else None
    if not config:
        raise ConfigError(f"{where}: not a model config (an empty or non-object JSON)")
    kind = config.get("model_type")
    if kind not in supported:
        raise ConfigError(f"{where}: architecture {kind!r} is not supported (supported: {', '.join(supported)})")
    for name in MODEL_SIZES + ("num_key_value_heads", "head_dim"):
        value = config.get(name)
        if value is None and name not in MODEL_SIZES:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{where}: {name} must be a positive integer, not {value!r}")
