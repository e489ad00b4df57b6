"""The physical KV pool: per-layer tensors allocated once, and their size in bytes."""
from dataclasses import dataclass

import torch

from kvchat.kernels import reference

from .config import Precision


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> "KVShape":
        config = getattr(config, "text_config", None) or config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.num_hidden_layers, kv_heads, head_dim)


def bytes_per_token(shape: KVShape, precision: Precision, dtype_bytes: int = 2) -> int:
    """K and V of one token over all layers."""
    if precision != Precision.FP16:
        raise NotImplementedError(f"KV precision {precision.value} is not available yet")
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def blocks_for_budget(shape: KVShape, precision: Precision, block_size: int, budget_bytes: int,
                      dtype_bytes: int = 2) -> int:
    return budget_bytes // (bytes_per_token(shape, precision, dtype_bytes) * block_size)


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device, precision: Precision = Precision.FP16):
        if precision != Precision.FP16:
            raise NotImplementedError(f"KV precision {precision.value} is not available yet")
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.precision, self.dtype = precision, dtype
        dims = (num_blocks, block_size, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(dims, dtype=dtype, device=device) for _ in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def read_blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        """Every tensor that a block id addresses, stacked over layers: ``[layers, n, ...]``."""
        index = torch.tensor(block_ids, device=self.k[0].device)
        return {"k": torch.stack([t.index_select(0, index) for t in self.k]).cpu(),
                "v": torch.stack([t.index_select(0, index) for t in self.v]).cpu()}

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor]) -> None:
        index = torch.tensor(block_ids, device=self.k[0].device)
        for name, layers in (("k", self.k), ("v", self.v)):
            data = tensors[name]
            if data.shape[1:] != (len(block_ids), *layers[0].shape[1:]) or data.shape[0] != len(layers):
                raise ValueError(f"stored {name} has shape {tuple(data.shape)}, the pool wants "
                                 f"{(len(layers), len(block_ids), *layers[0].shape[1:])}")
            for layer, t in enumerate(layers):
                t.index_copy_(0, index, data[layer].to(t.device, t.dtype))

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
        reference.write_kv(self.k[layer], self.v[layer], key, value, slots)

    def attend(self, layer: int, query: torch.Tensor, block_table: torch.Tensor, context_len: int,
               scale: float, first_block: int | None = None) -> torch.Tensor:
        return reference.paged_attention(query, self.k[layer], self.v[layer], block_table, context_len, scale,
                                         first_block)
