"""What fits in memory: the precision planner, and the snapshot of where memory goes (the engine's
probe, engine/memory_probe.py, fills it).

The planner works from a model config alone, before any weights load. KV bytes per token follow
2 x layers x kv_heads x head_dim x bytes per element, with the quantized modes' fp16 group scales
(one per 32 values) counted in.

Nothing here imports torch (a test holds it to that): the app plans with it while its window opens,
before the engine (and torch) loads on a worker thread.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

from kvchat.core.config import BLOCK_SIZE, ORDER, Precision
from kvchat.core.kv_sizes import (SINK_CACHE_ENTRIES, SLICE_BLOCKS, KVShape, config_value, layer_block_bytes,
                                  pool_blocks, pool_bytes, pool_nbytes, quantizable, windowed_layers)
from kvchat.core.memory_policy import MemoryPolicy
from kvchat.core.kv_format import READ_SLICE, window_bytes

GiB = 1 << 30
PRECISIONS = ORDER  # best first
PREFIX_RESERVE = 0.25  # Auto also wants room for this share of the context as cached prefixes


def pool_span(context: int) -> int:
    """The tokens a pool for ``context`` serves: the context and the prefix-cache reserve."""
    return int(context * (1 + PREFIX_RESERVE))
# int4: kvchat's CPU weights, groups of 32 with a 16-bit scale and zero each; nf4: bitsandbytes'
WEIGHT_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "int8": 1.0, "int4": 0.5 + 4 / 32, "nf4": 0.5 + 4 / 64 / 8 * 2}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?B?)\s*", text, re.I)
    if not m:
        raise ValueError(f"not a memory size: {text!r} (try 24GiB or 8000MB)")
    base = 1024 if m.group(3).lower().startswith("i") or not m.group(3) else 1000
    return int(float(m.group(1)) * base ** " KMGT".index(m.group(2).upper() or " "))


def parameter_counts(config) -> tuple[int, int]:
    """(parameters of the linear layers that 8-bit/nf4 quantize, all other parameters)."""

    hidden, inter, vocab = (config_value(config, n) for n in ("hidden_size", "intermediate_size", "vocab_size"))
    shape = KVShape.from_config(config)
    heads = config_value(config, "num_attention_heads")
    q_out, kv_out = heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    linear = shape.num_layers * (hidden * q_out + 2 * hidden * kv_out + q_out * hidden + 3 * hidden * inter)
    other = vocab * hidden * (1 if config_value(config, "tie_word_embeddings", False) else 2)
    other += shape.num_layers * 2 * hidden + hidden
    kind = config_value(config, "model_type")
    if kind == "qwen2":
        other += shape.num_layers * (q_out + 2 * kv_out)  # q/k/v biases
    if kind in ("qwen3", "gemma3_text"):
        other += shape.num_layers * 2 * shape.head_dim  # q/k norms
    if kind in ("gemma2", "gemma3_text"):
        other += shape.num_layers * 2 * hidden  # norms after attention and around the MLP
    return linear, other


def weights_bytes(config, weights: str = "bf16") -> int:
    """bitsandbytes leaves embeddings, the LM head and norms in 16-bit."""
    linear, other = parameter_counts(config)
    return int(linear * WEIGHT_BYTES[weights] + other * (4 if weights == "fp32" else 2))


def activations_bytes(config, chunk: int = 512, act_bytes: int = 2, context: int = 0) -> int:
    """Peak working memory of one prefill chunk at the end of a ``context``-token sequence: hidden
    states, MLP intermediates, one row of fp32 logits, attention's working set, the sequence's
    full-precision window of sink and newest K/V and the cache of sinks (quantized modes), and a
    fixed allowance for the framework's workspaces. A rebuild's conversion slice runs between
    steps, so the larger of the two is reserved."""

    hidden, inter, vocab = (config_value(config, n) for n in ("hidden_size", "intermediate_size", "vocab_size"))
    shape = KVShape.from_config(config)
    window = window_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, act_bytes)
    sinks = SINK_CACHE_ENTRIES * window_bytes(shape.num_layers, shape.num_kv_heads, shape.head_dim, act_bytes, size=0)
    model = chunk * (6 * hidden + 3 * inter) * act_bytes + 4 * vocab
    working = max(attention_bytes(config, chunk, context, act_bytes), slice_bytes(shape))
    return model + working + window + sinks + 256 * (1 << 20)


def attention_bytes(config, chunk: int, context: int, act_bytes: int = 2) -> int:
    """One layer's attention over ``context`` tokens for a ``chunk`` of queries, as
    ``reference.paged_attention`` runs it on CUDA: the context's K and V in the model's dtype, the
    boolean mask (grouped query heads folded into its rows) and its conversion to the dtype, an fp32
    slice of dequantized rows, and the queries and output in fp32. Measured in test_memory."""

    shape = KVShape.from_config(config)
    heads = config_value(config, "num_attention_heads")
    groups = heads // shape.num_kv_heads
    per_token = 2 * shape.num_kv_heads * shape.head_dim * act_bytes + groups * chunk * (1 + act_bytes)
    fp32_slice = 3 * READ_SLICE * shape.num_kv_heads * shape.head_dim * 4
    return context * per_token + fp32_slice + 3 * chunk * heads * shape.head_dim * 4


def slice_bytes(shape: KVShape, block_size: int = BLOCK_SIZE) -> int:
    """Working memory of converting ``SLICE_BLOCKS`` blocks in a rebuild (``convert.converted``):
    their K and V in fp32 a few times over (dequantized, un-rotated, re-rotated, grouped for
    rounding). Measured in test_kv_cache: 0.9x of this."""

    return 7 * SLICE_BLOCKS * block_size * shape.num_kv_heads * shape.head_dim * 4


@dataclass
class Plan:
    memory: int
    weights: int
    activations: int
    headroom: int
    kv_budget: int
    requested_context: int
    bytes_per_token: dict = field(default_factory=dict)  # what a token more takes (whole-context layers)
    max_context: dict = field(default_factory=dict)
    ring_bytes: dict = field(default_factory=dict)  # windowed layers' rings, a fixed size (kv_sizes.ring_blocks)
    auto: str | None = None  # None: not even int4 holds the requested context

    def as_dict(self) -> dict:
        return asdict(self)


def plan(config, memory: int, context: int, weights: str = "bf16", headroom: int = GiB,
         kv_full_bytes: int = 2, block_size: int = BLOCK_SIZE, chunk: int = 512,
         weights_size: int | None = None) -> Plan:
    """For each precision the largest context the memory holds, and Auto's pick: the highest
    precision of its ladder that holds ``context`` plus the prefix-cache reserve."""

    w = weights_size if weights_size is not None else weights_bytes(config, weights)
    act = activations_bytes(config, chunk, kv_full_bytes, context)
    budget = max(0, memory - w - act - headroom)
    shape = KVShape.from_config(config)
    p = Plan(memory, w, act, headroom, budget, context)
    need = pool_span(context)
    for precision in PRECISIONS:
        blocks, local = pool_blocks(shape, precision, block_size, budget, kv_full_bytes, span=need)
        whole = shape.num_layers - windowed_layers(shape, local)
        p.bytes_per_token[precision.value] = layer_block_bytes(shape, precision, block_size, kv_full_bytes) \
            / block_size * whole
        p.ring_bytes[precision.value] = pool_nbytes(shape, precision, 0, local, kv_full_bytes, block_size)
        # a model wholly in rings holds any context in them: it is given the one asked for
        p.max_context[precision.value] = blocks * block_size if whole else need
    holds = [q for q in MemoryPolicy(Precision.AUTO, quantizable(shape)).rungs()
             if budget >= pool_bytes(shape, q, need, kv_full_bytes, block_size)]
    p.auto = holds[0].value if holds else None
    return p


def format_plan(p: Plan) -> str:
    g = lambda n: f"{n / GiB:.2f} GiB"
    lines = [f"memory {g(p.memory)}: weights {g(p.weights)}, activations {g(p.activations)}, "
             f"headroom {g(p.headroom)}, KV cache {g(p.kv_budget)}"]
    for name, per_token in p.bytes_per_token.items():
        rings = f" + {p.ring_bytes[name] / 2**20:,.0f} MiB of windowed layers" if p.ring_bytes.get(name) else ""
        lines.append(f"  {name:<5} {per_token / 1024:8.1f} KiB/token{rings}   holds {p.max_context[name]:>9,} tokens")
    want = f"{p.requested_context:,} tokens (+{PREFIX_RESERVE:.0%} prefix cache)"
    lines.append(f"Auto for {want}: {p.auto or 'nothing fits; lower the context or free memory'}")
    return "\n".join(lines)


@dataclass
class MemorySnapshot:
    device: str  # "cuda:0 (name)" or "cpu"
    total: int
    other_processes: int
    weights: int
    kv_total: int
    kv_in_use: int
    kv_reclaimable: int
    activations_reserve: int
    free: int
    precision: str
    max_context: dict
    on_cpu: bool
    # the KV tiers under the pool: ram_used, ram_capacity, ram_hits, disk_used, disk_capacity,
    # disk_hits (bytes; hits in blocks restored); empty where there are none
    tiers: dict = field(default_factory=dict)
    # what kvchat's own process holds besides the weights and the pool: Python, Qt, torch (and the
    # CUDA context; on the CPU, the RAM copy of cached conversations too)
    runtime: int = 0
