"""What the KV cache takes, from a model config alone: the shape of its K/V, and bytes per token in
each precision. No torch: the planner and the app's settings count with it before any model loads."""
from dataclasses import dataclass

from kvchat.core.config import Precision, text_config
from kvchat.core.kv_format import FORMATS, token_bytes

SINK_CACHE_ENTRIES = 16  # distinct conversation openings whose full-precision sinks are kept
SLICE_BLOCKS = 256  # blocks converted at a time in a rebuild
# rings a pool keeps for its windowed layers: sequences running past their window at once, with
# the last ended one kept for its chat's next turn (``engine/kv/rings.py``)
LOCAL_RINGS = 3


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    windows: tuple = ()  # per layer, its sliding window or None; () when no layer has one

    @classmethod
    def from_config(cls, config) -> "KVShape":
        """From a transformers config or a config.json dict."""
        get = lambda name: config_value(config, name)
        heads = get("num_attention_heads")
        return cls(get("num_hidden_layers"), get("num_key_value_heads") or heads,
                   get("head_dim") or get("hidden_size") // heads, layer_windows(config))

    @property
    def local_layers(self) -> tuple[int, ...]:
        return tuple(i for i, w in enumerate(self.windows) if w)


def layer_windows(config) -> tuple:
    """Each layer's sliding window (None: it sees the whole context), as transformers gives the
    layers theirs: ``layer_types`` where the config has them (Gemma 2 and 3, Qwen2), else one
    window for every layer (Mistral v0.1, Phi-3). A config.json without ``layer_types`` gets the
    pattern its class would make."""
    get = lambda name, default=None: config_value(config, name, default)
    window, layers, kind = get("sliding_window"), get("num_hidden_layers"), get("model_type")
    types = get("layer_types")
    if types is None and kind in ("qwen2", "qwen3"):
        start = get("max_window_layers", layers) if get("use_sliding_window", False) else layers
        types = ["sliding_attention" if i >= start else "full_attention" for i in range(layers)]
    elif types is None and kind == "gemma2":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    elif types is None and kind == "gemma3_text":
        every = get("sliding_window_pattern", 6)
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    if not window:
        return ()
    windows = tuple(int(window) if t == "sliding_attention" else None for t in types) if types is not None \
        else (int(window),) * layers
    return windows if any(windows) else ()


def ring_blocks(shape: KVShape, block_size: int) -> int:
    """Blocks in one sequence's ring for its windowed layers: enough for the window's W - 1 earlier
    positions and the newest token wherever a block boundary falls, so ``W + block_size`` tokens at
    most. 0 where no layer has a window."""
    local = shape.local_layers
    if not local:
        return 0
    return -(-(max(shape.windows[i] for i in local) - 1) // block_size) + 1


def layer_block_bytes(shape: KVShape, precision: Precision, block_size: int, full_bytes: int = 2) -> float:
    """One block of one layer's K and V, scales included."""
    fmt = FORMATS[Precision(precision).value]
    return block_size * token_bytes(fmt, shape.num_kv_heads, shape.head_dim, full_bytes, block_size)


def windowed_layers(shape: KVShape, local_blocks: int) -> int:
    """Layers whose rows are in rings: the windowed ones, where the pool has ring blocks."""
    return len(shape.local_layers) if local_blocks else 0


def local_blocks_for(shape: KVShape, block_size: int, tokens: int) -> int:
    """Blocks of the windowed layers' rings in a pool of ``tokens`` whole-context tokens: the
    rings of ``LOCAL_RINGS`` sequences, or 0 where rings would not take less (a short context)."""
    rings = ring_blocks(shape, block_size) * LOCAL_RINGS
    return rings if rings < -(-int(tokens) // block_size) else 0


def pool_nbytes(shape: KVShape, precision: Precision, blocks: int, local_blocks: int, full_bytes: int = 2,
                block_size: int = 16, ringed: bool | None = None) -> int:
    """``blocks`` whole-context blocks and ``local_blocks`` ring blocks of the windowed layers;
    ``ringed``: whether the windowed layers are in rings (by default, where there are ring blocks)."""
    windowed = windowed_layers(shape, local_blocks if ringed is None else ringed)
    layers = blocks * (shape.num_layers - windowed) + local_blocks * windowed
    return int(layers * layer_block_bytes(shape, precision, block_size, full_bytes))


def pool_bytes(shape: KVShape, precision: Precision, tokens: int, full_bytes: int = 2,
               block_size: int = 16, rings: bool = True) -> int:
    """A pool with room for ``tokens`` whole-context tokens: its windowed layers in rings where
    those take less (``rings``), so their bytes stop growing at the rings' size."""
    local = local_blocks_for(shape, block_size, tokens) if rings else 0
    return pool_nbytes(shape, precision, -(-int(tokens) // block_size), local, full_bytes, block_size)


def pool_blocks(shape: KVShape, precision: Precision, block_size: int, budget_bytes: int, full_bytes: int = 2,
                local: int | None = None, span: int = 0) -> tuple[int, int]:
    """``(whole-context blocks, ring blocks)`` that ``budget_bytes`` hold; ``local`` keeps a pool's
    ring blocks as they are (a rebuild), None lets the budget decide: rings where they leave more
    whole-context blocks than they take. Where every layer is in rings (Mistral v0.1, Phi-3), a
    block id holds no bytes and the budget does not bound the ids: the pool gets ``span`` tokens'
    worth (the context it serves) for each ring's sequence, where the budget holds the rings, and
    none without a span."""
    if local is None:
        rings = ring_blocks(shape, block_size) * LOCAL_RINGS
        local = rings if rings and pool_blocks(shape, precision, block_size, budget_bytes, full_bytes, rings,
                                               span)[0] > rings else 0
    per_layer = layer_block_bytes(shape, precision, block_size, full_bytes)
    windowed = windowed_layers(shape, local)
    rest = budget_bytes - local * windowed * per_layer
    if windowed == shape.num_layers:
        return (-(-int(span) // block_size) * LOCAL_RINGS if rest >= 0 else 0), local
    return max(0, int(rest // ((shape.num_layers - windowed) * per_layer))), local


def quantizable(shape: KVShape) -> bool:
    """Whether the quantized precisions can hold this shape: they rotate each head by a Hadamard
    matrix, which exists at powers of two (Phi-3-mini's head_dim of 96 has none)."""
    return shape.head_dim > 0 and shape.head_dim & (shape.head_dim - 1) == 0


def config_value(config, name: str, default=None):
    config = text_config(config)
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


def bytes_per_token(shape: KVShape, precision: Precision, full_bytes: int = 2) -> float:
    """K and V of one token over all layers, scales included; ``full_bytes`` is the size of the
    model dtype that fp16 mode stores (4 on the CPU, where it is fp32)."""
    fmt = FORMATS[Precision(precision).value]
    return shape.num_layers * token_bytes(fmt, shape.num_kv_heads, shape.head_dim, full_bytes)


def blocks_for_budget(shape: KVShape, precision: Precision, block_size: int, budget_bytes: int,
                      full_bytes: int = 2) -> int:
    return int(budget_bytes // (bytes_per_token(shape, precision, full_bytes) * block_size))
