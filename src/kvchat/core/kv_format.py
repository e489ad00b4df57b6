"""The KV layout's sizes, without torch: how many bits each precision stores, the group and window
sizes, and the bytes they take. kernels/quant.py is the layout as tensor code; this is the part the memory
planner (kvchat.core, which loads no torch) needs to count bytes before any model loads."""
from dataclasses import dataclass

GROUP = 32  # values along head_dim sharing one fp16 scale
SCALE_BYTES = 2  # fp16
WINDOW = 64  # newest tokens of a sequence kept in full precision
SINKS = 4  # first tokens of a sequence kept in full precision
READ_SLICE = 2048  # tokens dequantized at a time when a prefill reads its past: bounds the fp32 copy


FP8_MAX = 448.0  # the largest finite e4m3 value
BLOCK = 16  # tokens a KV block holds where no other size is given (core.config.BLOCK_SIZE)
# per-block key statistics (int4): per block and channel, a one-byte scale code and an fp16 minimum
BLOCK_STATS_BYTES = 1 + 2


@dataclass(frozen=True)
class KVFormat:
    name: str
    k_bits: int  # 16: the model's dtype, unquantized
    v_bits: int
    float8: bool = False  # e4m3 codes with no per-token scale (one per layer and KV head, folded in)
    block_keys: bool = False  # keys quantized per channel over each block's tokens, not per token

    @property
    def quantized(self) -> bool:
        return self.k_bits < 16 or self.v_bits < 16

    @property
    def transform(self) -> str | None:
        """Which transform a window's and the sink cache's rows are in: int8 and k8v4 centre and
        scale keys by calibration, int4 (statistics per block) only rotates them."""
        if not self.quantized:
            return None
        return "fp8" if self.float8 else "rotated" if self.block_keys else "int"


FORMATS = {f.name: f for f in (KVFormat("fp16", 16, 16), KVFormat("int8", 8, 8), KVFormat("fp8", 8, 8, True),
                               KVFormat("k8v4", 8, 4), KVFormat("int4", 4, 4, block_keys=True))}


def qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def element_bytes(bits: int, full_bytes: int = 2, grouped: bool = True) -> float:
    """Bytes per K or V element, its share of the group's fp16 scale included (``grouped``)."""
    return full_bytes if bits == 16 else bits / 8 + (SCALE_BYTES / GROUP if grouped else 0)


def token_bytes(fmt: KVFormat, kv_heads: int, head_dim: int, full_bytes: int = 2, block_size: int = BLOCK) -> float:
    """K and V of one token in one layer, scales (and a token's share of its block's key
    statistics) included."""
    grouped = not fmt.float8
    k = fmt.k_bits / 8 + BLOCK_STATS_BYTES / block_size if fmt.block_keys else element_bytes(fmt.k_bits, full_bytes, grouped)
    return kv_heads * head_dim * (k + element_bytes(fmt.v_bits, full_bytes, grouped))


def window_bytes(layers: int, kv_heads: int, head_dim: int, full_bytes: int, size: int = WINDOW,
                 sinks: int = SINKS) -> int:
    """One sequence's full-precision window (``RecentWindow``): K and V of its sinks and newest rows."""
    return 2 * layers * (sinks + size) * kv_heads * head_dim * full_bytes
