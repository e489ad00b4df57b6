"""One dispatch: Triton on CUDA, the torch reference everywhere else.

On CUDA, quantized writes go through the fused kernel and single-token decode through the paged
decode kernel; prefill chunks dequantize into a temporary buffer and use SDPA (the reference path).
"""
import torch

from . import reference

try:
    from . import triton_kv
except ImportError:  # no triton on this platform
    triton_kv = None


def use_triton(t: torch.Tensor) -> bool:
    return triton_kv is not None and t.is_cuda


def write_kv(tensors, fmt, key, value, slots, rotation=None, k_center=None, k_channel_scale=None) -> None:
    if fmt.quantized and use_triton(key):
        triton_kv.quantize_write(tensors, fmt, key, value, slots, rotation, k_center, k_channel_scale)
    else:
        reference.write_kv(tensors, fmt, key, value, slots, rotation, k_center, k_channel_scale)


def paged_attention(query, tensors, fmt, block_table, context_len, scale, first_block=None, rotation=None,
                    k_channel_scale=None) -> torch.Tensor:
    if query.shape[0] == 1 and use_triton(query):
        lens = torch.tensor([context_len], device=query.device, dtype=torch.int32)
        return triton_kv.paged_decode(query, tensors, fmt, block_table[None].to(torch.int32), lens, scale,
                                      rotation, k_channel_scale)
    return reference.paged_attention(query, tensors, fmt, block_table, context_len, scale, first_block, rotation,
                                     k_channel_scale)
