"""The attention function kvchat registers with transformers: K/V go to and come from our pool."""
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

from kvchat.kernels.quant import RecentWindow

from .kv_cache import KVCache

ATTN_NAME = "kvchat_paged"


@dataclass
class StepMeta:
    """What one forward step needs to find its K/V: passed to the model as ``kv_meta=``."""
    kv: KVCache
    slots: torch.Tensor  # [T], one per new token
    block_table: torch.Tensor  # [num_blocks of the sequence]
    context_len: int  # tokens in the sequence after this step
    first_block: int | None = None  # set when the block table is one run of consecutive ids
    window: RecentWindow | None = None  # the sequence's newest tokens in full precision (quantized modes)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            sliding_window=None, kv_meta: StepMeta | None = None, **kwargs):
    """query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` after RoPE; returns ``[1, T, H, D]``."""
    if kv_meta is None:
        raise RuntimeError("kvchat attention was called without step metadata (kv_meta)")
    if sliding_window is not None and sliding_window < kv_meta.context_len:
        raise NotImplementedError("sliding-window attention layers are not supported by kvchat yet")
    if query.shape[0] != 1:
        raise ValueError("kvchat attention runs one sequence per forward")
    layer = module.layer_idx
    first_pos = kv_meta.context_len - key.shape[2]
    kv_meta.kv.write(layer, key[0].transpose(0, 1), value[0].transpose(0, 1), kv_meta.slots, kv_meta.window,
                     first_pos)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kv_meta.kv.attend(layer, query[0].transpose(0, 1), kv_meta.block_table, kv_meta.context_len, scale,
                            kv_meta.first_block, kv_meta.window)
    return out.unsqueeze(0), None


AttentionInterface.register(ATTN_NAME, paged_attention_forward)
