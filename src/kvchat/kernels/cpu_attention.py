"""A decode step's attention over an fp32 pool on the CPU: ``decode_attention.cpp`` and its twin.

The compiled step calls ``torch.ops.kvchat.decode_attention`` after writing the step's K/V
(``traced.write``). Traced instead, the attention took 127-135 us a layer of the starter at 576
positions, a quarter of a token on AVX-512 and AVX2 alike; the kernel splits the positions
over the threads and takes about a third of that. It lives in the int8 kernel's library
(``int8_rows``: built, prebuilt and loaded with it); until that is loaded the op runs the twin,
``traced.attend``, whose torch ops are what the step traced before.
"""
import torch

from kvchat.kernels import int8_rows, traced
from kvchat.kernels.reference import Band

# read once: a step being traced cannot call torch.cpu.get_capabilities (not a tensor op)
_CPU_RUNS = int8_rows.cpu_supported()

_library = torch.library.Library("kvchat", "FRAGMENT")
_library.define("decode_attention(Tensor query, Tensor k, Tensor v, Tensor table, Tensor length, float scale, "
                "int window) -> Tensor")


def takes(pool: dict, query: torch.Tensor, band: Band) -> bool:
    """Whether the kernel serves this layer: an fp32 pool and query, rows a multiple of 8 wide, no
    soft cap (Gemma 2's stays traced), on a CPU that runs the int8 kernel (AVX2 and up). Decided
    when the step is traced, the same way in the compile child as here, whether or not the library
    is loaded yet; where its build failed, the traced ops (the twin, run eagerly as an opaque op,
    is slower)."""
    k = pool["k"]
    return (k.dtype == torch.float32 and query.dtype == torch.float32 and k.shape[-1] % 8 == 0
            and band.softcap is None and _CPU_RUNS and not int8_rows.failed)


def attend(pool: dict, query: torch.Tensor, table: torch.Tensor, length: torch.Tensor, scale: float,
           band: Band) -> torch.Tensor:
    """``traced.attend``'s contract, through the op."""
    return torch.ops.kvchat.decode_attention(query, pool["k"], pool["v"], table, length, scale, band.window or 0)


def twin(query, k, v, table, length, scale: float, window: int) -> torch.Tensor:
    return traced.attend({"k": k, "v": v}, query, table, length, scale, Band(window or None, None))


def decode_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                     length: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    """query ``[rows, heads, D]`` over pool ``k``/``v`` ``[blocks, block, kv_heads, D]``, row ``i``
    through ``table[i]`` (``[blocks]`` for one row) up to ``length[i]``, the last ``window``
    positions only where it is above 0. A row of no positions gives zeros (the twin: NaN)."""
    if int8_rows.attention is None:
        return twin(query, k, v, table, length, scale, window)
    # the compiled step's tensors are already of these kinds: each conversion or check here costs
    # microseconds, 30 times a token; the kernel checks each row's length against the table itself
    if table.dtype != torch.int64:
        table = table.long()
    if length.dtype != torch.int32:
        length = length.int()
    query = query.contiguous()
    rows, heads, d = query.shape
    _, block, kv_heads, _ = k.shape
    stride = table.numel() // rows  # blocks a row's table holds
    if not (k.dtype == v.dtype == query.dtype == torch.float32 and k.shape == v.shape and k.shape[3] == d
            and d % 8 == 0 and heads % kv_heads == 0 and k.is_contiguous() and v.is_contiguous()
            and table.is_contiguous() and stride * rows == table.numel() and length.numel() == rows):
        raise ValueError(f"decode_attention: query {tuple(query.shape)} {query.dtype} against a pool "
                         f"{tuple(k.shape)} {k.dtype}, {tuple(table.shape)} table and {length.numel()} lengths")
    out = torch.empty_like(query)
    status = int8_rows.attention(query.data_ptr(), k.data_ptr(), v.data_ptr(), table.data_ptr(), stride,
                                 length.data_ptr(), rows, heads, kv_heads, d, block, window, scale, out.data_ptr(),
                                 torch.get_num_threads())
    if status == 2:
        raise ValueError(f"decode_attention: a length in {length.tolist()} is past a table of {stride} blocks of {block}")
    if status:
        raise MemoryError(f"decode_attention: no scratch for {rows} rows of {heads} heads")
    return out


_library.impl("decode_attention", decode_attention, "CPU")


@torch.library.register_fake("kvchat::decode_attention")
def _(query, k, v, table, length, scale, window):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
