"""The attention kvchat registers with transformers: K/V go to and come from our pool.

The work is one torch custom op, ``kvchat::paged_attention``, so that ``torch.compile`` traces the
whole model forward without a graph break. The op finds the pool and the step's block table in the
step being run (``running(meta)``), as vLLM's attention op finds its forward context: a model
forward takes tensors only, and a per-step Python value passed through it would make the compiled
step recompile every token.
"""
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvchat.kernels import cpu_attention, traced
from kvchat.engine.kv.recent_window import RecentWindow
from kvchat.kernels.reference import PLAIN, Band

from kvchat.engine.kv.cache import KVCache

ATTN_NAME = "kvchat_paged"


@dataclass
class StepMeta:
    """What one forward step needs to find its K/V."""
    kv: KVCache
    slots: torch.Tensor  # [T], one per new token
    block_table: torch.Tensor  # [num_blocks of the sequence], int32; may be padded in a captured step
    context_len: int  # tokens in the sequence after this step
    first_block: int | None = None  # set when the block table is one run of consecutive ids
    window: RecentWindow | None = None  # the sequence's newest tokens in full precision (quantized modes)
    context_lens: torch.Tensor | None = None  # [1] int32 holding context_len: a captured step reads it here
    window_meta: torch.Tensor | None = None  # int32 [s, first, ring row, position]: likewise, the window's bounds


@dataclass
class BatchMeta:
    """A batched decode step: one token of each sequence, row ``i`` of the forward served by
    ``rows[i]`` (a padding row by a meta whose pool takes nothing and gives zeros)."""
    rows: list[StepMeta]


_running = threading.local()  # per thread: two engines (a model switch, a benchmark) never share a step


@contextmanager
def running(meta: StepMeta):
    """Make ``meta`` the step that the attention op of every layer on this thread serves."""
    _running.meta = meta
    try:
        yield meta
    finally:
        _running.meta = None


@torch.library.custom_op("kvchat::paged_attention", mutates_args=())
def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                    sliding_window: int, softcap: float) -> torch.Tensor:
    """query ``[T, H, D]``, key/value ``[T, Hkv, D]`` of the new tokens -> ``[T, H, D]``. Writes the
    new K/V into the pool of the running step (a side effect the op's schema cannot name: the pool is
    not an argument), then attends over the sequence. In a batched step (``BatchMeta``) row ``i`` is
    one token of sequence ``i``. ``sliding_window`` -1 and ``softcap`` 0 when the layer has none."""
    meta = getattr(_running, "meta", None)
    if meta is None:
        raise RuntimeError("kvchat attention was called outside a step (engine.attention.running)")
    band = band_of(sliding_window, softcap)
    if isinstance(meta, BatchMeta):
        return torch.cat([_attend(row, query[i:i + 1], key[i:i + 1], value[i:i + 1], layer, scale, band)
                          for i, row in enumerate(meta.rows)])
    return _attend(meta, query, key, value, layer, scale, band)


def band_of(sliding_window, softcap) -> Band:
    """The op's plain arguments (None, -1 and 0 for none) as a ``Band``."""
    window = None if sliding_window is None or sliding_window < 0 else int(sliding_window)
    return Band(window, float(softcap) if softcap else None)


def _attend(meta: StepMeta, query, key, value, layer: int, scale: float, band: Band) -> torch.Tensor:
    kv, first_pos = meta.kv, meta.context_len - key.shape[0]
    write = lambda: kv.write(layer, key, value, meta.slots, meta.window, first_pos, meta.window_meta)
    ahead = key.shape[0] > 1 and layer in getattr(kv, "local", ())  # a chunk in a ring: read, then write
    fresh = kv.fresh(layer, key, value) if ahead else write()
    out = kv.attend(layer, query, meta.block_table, meta.context_len, scale, meta.first_block, meta.window,
                    meta.context_lens, fresh, meta.window_meta, band)
    if ahead:
        write()
    return out.contiguous()  # the strides the fake promises: compiled code relies on them


@paged_attention.register_fake
def _(query, key, value, layer, scale, sliding_window, softcap):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def traced_step(step: dict, layer: int, query, key, value, scale: float, band: Band = PLAIN) -> torch.Tensor:
    """The CPU's compiled decode step over an fp16 pool: ``kernels.traced`` on the tensors in
    ``step`` (``DecodeStep.traced_inputs``), query ``[rows, H, D]`` -> ``[rows, H, D]``, a row per
    sequence of a batch."""
    pool = step["layers"][layer]
    traced.write(pool, key, value, step["slot"])
    attend = cpu_attention.attend if cpu_attention.takes(pool, query, band) else traced.attend
    return attend(pool, query, step["table"], step["length"], scale, band)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, softcap=None, kvchat_step=None, **kwargs):
    """query ``[B, H, T, D]``, key/value ``[B, Hkv, T, D]`` after RoPE; returns ``[B, T, H, D]``.
    One sequence (B = 1) or a batched decode step (T = 1, a sequence per row). ``kvchat_step``,
    given by the CPU's compiled decode step, routes it to ``traced_step``."""
    batch, _, tokens, _ = query.shape
    if batch != 1 and tokens != 1:
        raise ValueError("kvchat attention runs one sequence per forward, or one token of each")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # [B, H, T, D] -> [B * T, H, D]: one sequence's tokens, or one token of each sequence
    q, k, v = (x.transpose(1, 2).flatten(0, 1) for x in (query, key, value))
    if kvchat_step is not None:
        out = traced_step(kvchat_step, module.layer_idx, q, k, v, float(scale), band_of(sliding_window, softcap))
    else:
        out = torch.ops.kvchat.paged_attention(q, k, v, module.layer_idx, float(scale),
                                               -1 if sliding_window is None else int(sliding_window),
                                               float(softcap or 0.0))
    return out.view(batch, tokens, *out.shape[1:]), None


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
