"""The prefill's dequantizing kernel (``triton_kv.dequantize_rows``) against the torch reference, in
the interpreter (TRITON_INTERPRET=1, set in conftest) or on CUDA (``make gpu-check``)."""
from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from kvchat.kernels import dispatch, quant, reference, triton_kv
from kvchat.engine.kv.recent_window import RecentWindow

from test_triton import DEVICE, on_device

pytestmark = pytest.mark.gpu  # runs on CUDA where there is one: make gpu-check's kernel step

BS = 16
QUANTIZED = ["int8", "fp8", "k8v4", "int4"]


def random_pool(fmt, num_blocks: int, kv_heads: int, head_dim: int, seed: int) -> dict:
    """Any codes and any fp16 scales over a wide range, not only what the quantizer writes: int4's
    nibble 0 (-8) included, e4m3's subnormals and +-448, and products whose rounding to bf16 has
    work to do."""
    g = torch.Generator().manual_seed(seed)
    pool = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    for name, t in pool.items():
        if name.endswith("_scale"):
            t.copy_(torch.rand(t.shape, generator=g) * 2.0 ** torch.randint(-14, 4, t.shape, generator=g))
        elif t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g))
        else:
            t.copy_(torch.randint(0, 256, t.shape, generator=g))
            if fmt.float8:  # every e4m3 code but NaN's, which writes never make (they saturate)
                t[(t & 0x7F) == 0x7F] -= 1
    return pool


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("kv_heads, head_dim", [(3, 64), (2, 128)])
def test_dequantized_rows_are_quant_reads_fp32_values_rounded_once(name, dtype, kv_heads, head_dim):
    """Positions 21 .. 138 (neither end on a block boundary) of a sequence whose blocks are
    shuffled, into the middle of a larger buffer: its rows before and after stay untouched."""
    fmt = quant.FORMATS[name]
    pool = random_pool(fmt, 12, kv_heads, head_dim, seed=kv_heads + head_dim)
    table = torch.randperm(12, generator=torch.Generator().manual_seed(5))[:9]  # 144 positions
    first, n = 21, 117
    for part in ("k", "v"):
        want = quant.read(pool, fmt, part, table, first + n, None, torch.float32)[first:].to(dtype)
        buffer = on_device(torch.full((n + 6, kv_heads, head_dim), -3.0, dtype=dtype))
        triton_kv.dequantize_rows(on_device(pool), fmt, part, on_device(table.to(torch.int32)), first, n,
                                  buffer[2:2 + n])
        got = buffer.cpu()
        assert torch.equal(got[2:2 + n], want), part
        assert (got[:2] == -3).all() and (got[2 + n:] == -3).all(), part


def test_an_empty_context_launches_nothing():
    fmt = quant.FORMATS["int8"]
    pool = on_device(random_pool(fmt, 2, 1, 64, seed=0))
    with mock.patch.object(triton_kv, "_dequantize_rows_kernel") as kernel:
        triton_kv.dequantize_rows(pool, fmt, "k", on_device(torch.tensor([1], dtype=torch.int32)), 0, 0,
                                  on_device(torch.empty(0, 1, 64)))
    assert not kernel.mock_calls


def chunk_scene(fmt, table, heads: int, kv_heads: int, head_dim: int, context: int, chunk: int, dtype):
    """A sequence of ``context`` tokens in the pool, its window written as a prefill keeps it, and
    the last ``chunk`` as a prefill chunk's query and fresh rows."""
    g = torch.Generator().manual_seed(context + chunk)
    pool = quant.layer_tensors(fmt, 16, BS, kv_heads, head_dim, torch.float32, "cpu")
    rot = quant.hadamard(head_dim)
    center, cscale = torch.randn(kv_heads, head_dim, generator=g), torch.rand(kv_heads, head_dim, generator=g) + 0.5
    recent = RecentWindow(1, kv_heads, head_dim, dtype, DEVICE)
    k, v = torch.randn(context, kv_heads, head_dim, generator=g) * 2, torch.randn(context, kv_heads, head_dim, generator=g)
    slots = table[torch.arange(context) // BS] * BS + torch.arange(context) % BS
    kept = []
    reference.write_kv(pool, fmt, k, v, slots, rot, center, cscale, lambda *rows: kept.append(rows))
    recent.store(0, 0, *(on_device(x) for x in kept[0]))
    fresh = tuple(x[-chunk:] for x in kept[0])
    query = torch.randn(chunk, heads, head_dim, generator=g).to(dtype)
    return pool, rot, cscale, recent, query, fresh


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shuffled", [True, False])
def test_a_prefill_chunk_on_the_cuda_path_reads_the_past_through_the_kernel_as_the_torch_slices_do(
        name, dtype, shuffled):
    """Dispatch told it is on CUDA, with the kernel and without (``reference.in_place`` is False
    there): the chunk's past rows come from the kernel, the window's and the chunk's own rows
    still from the reference, and the attention is bit for bit the torch slices' (a few positions
    a slice here, so that they start mid-block as the kernel's rows do). A consecutive table also
    passes ``first_block``, which the kernel has no use for."""
    fmt = quant.FORMATS[name]
    context, chunk, heads, kv_heads, head_dim = 150, 40, 4, 2, 64
    table = torch.randperm(16, generator=torch.Generator().manual_seed(1))[:10] if shuffled else torch.arange(3, 13)
    first_block = None if shuffled else 3
    pool, rot, cscale, recent, query, fresh = chunk_scene(fmt, table, heads, kv_heads, head_dim, context, chunk, dtype)
    s, first = recent.bounds(0, context)
    assert s == 4 and first == context - 64  # sinks and a window over the past: both substituted

    def attend(kernel_too: bool) -> torch.Tensor:
        with mock.patch.object(dispatch, "use_triton", lambda *args: kernel_too), \
                mock.patch.object(reference, "in_place", lambda *args: False), \
                mock.patch.object(reference, "READ_SLICE", 24):
            return dispatch.paged_attention(on_device(query), on_device(pool), fmt, on_device(table.to(torch.int32)),
                                            context, head_dim ** -0.5, first_block, on_device(rot), on_device(cscale),
                                            (recent, 0), fresh=tuple(on_device(x) for x in fresh))

    with mock.patch.object(triton_kv, "dequantize_rows", wraps=triton_kv.dequantize_rows) as kernel:
        want = attend(False)
        assert not kernel.called
        got = attend(True)
    assert [c.args[2] for c in kernel.call_args_list] == ["k", "v"]
    assert [c.args[4:6] for c in kernel.call_args_list] == [(0, context - chunk)] * 2
    assert torch.equal(got, want)


@triton.jit
def _fp8_round_trip(x_ptr, code_ptr, back_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(code_ptr + i, triton_kv._to_fp8(tl.load(x_ptr + i)).to(tl.uint8))
    tl.store(back_ptr + i, triton_kv.load_fp8(code_ptr, i, i < N, 1).to(tl.float32))


def test_the_kernels_fp8_codes_are_torchs_bit_for_bit():
    """The write kernel's rounding (``_to_fp8``) and the reads without hardware fp8 (``load_fp8``)
    against torch's e4m3 (``quant.to_fp8``, ``quant.from_fp8``) on every code's value, the midpoints
    between neighbours (ties go to the even code), values just off them, e4m3's subnormals, zeros of
    both signs and values past +-448 (saturated)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    values = quant.from_fp8(codes).sort().values
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), torch.tensor([0.0, -0.0, 449.0, -1e4, 5e-4])])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    code, back = on_device(torch.zeros(n, dtype=torch.uint8)), on_device(torch.zeros(n))
    _fp8_round_trip[(1,)](on_device(x), code, back, N=n)
    assert torch.equal(code.cpu(), quant.to_fp8(x))
    assert torch.equal(back.cpu(), quant.from_fp8(quant.to_fp8(x)))
