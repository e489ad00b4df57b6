"""What the KV cache takes, from a model config alone: the shape of its K/V, and bytes per token in
each precision. No torch: the planner and the app's settings count with it before any model loads."""
from dataclasses import dataclass

from kvchat.core.config import Precision
from kvchat.kernels.layout import FORMATS, token_bytes

SINK_CACHE_ENTRIES = 16  # distinct conversation openings whose full-precision sinks are kept
SLICE_BLOCKS = 256  # blocks converted at a time in a rebuild


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> "KVShape":
        """From a transformers config or a config.json dict."""
        get = lambda name: config_value(config, name)
        heads = get("num_attention_heads")
        return cls(get("num_hidden_layers"), get("num_key_value_heads") or heads,
                   get("head_dim") or get("hidden_size") // heads)


def quantizable(shape: KVShape) -> bool:
    """Whether the quantized precisions can hold this shape: they rotate each head by a Hadamard
    matrix, which exists at powers of two (Phi-3-mini's head_dim of 96 has none)."""
    return shape.head_dim > 0 and shape.head_dim & (shape.head_dim - 1) == 0


def lowest_precision(shape: KVShape, precision: Precision, auto: bool) -> Precision:
    """What a pool may step down to: Auto to int4 where the shape can be quantized, else nowhere."""
    return Precision.INT4 if auto and quantizable(shape) else Precision(precision)


def config_value(config, name: str, default=None):
    config = getattr(config, "text_config", None) or config
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def bytes_per_token(shape: KVShape, precision: Precision, full_bytes: int = 2) -> float:
    """K and V of one token over all layers, scales included; ``full_bytes`` is the size of the
    model dtype that fp16 mode stores (4 on the CPU, where it is fp32)."""
    fmt = FORMATS[Precision(precision).value]
    return shape.num_layers * token_bytes(fmt, shape.num_kv_heads, shape.head_dim, full_bytes)


def blocks_for_budget(shape: KVShape, precision: Precision, block_size: int, budget_bytes: int,
                      full_bytes: int = 2) -> int:
    return int(budget_bytes // (bytes_per_token(shape, precision, full_bytes) * block_size))
