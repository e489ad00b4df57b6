"""The CPU decode attention (``kernels/decode_attention.cpp``) against its twin, the traced torch ops
the compiled step ran before: one row and a batch's rows, windows, head sizes, padded tables."""
import pytest
import torch

from kvchat.kernels import cpu_attention, int8_rows, traced
from kvchat.kernels.reference import PLAIN, Band

BS = 16


@pytest.fixture(scope="module")
def built():
    from kvchat.engine.compile_env import use_disk_cache

    if not int8_rows.cpu_supported():
        pytest.skip("this CPU runs none of the kernel library's variants (x86-64 with AVX2 and up)")
    use_disk_cache()
    assert int8_rows.build() and int8_rows.attention is not None


def pool(blocks: int, kv_heads: int, d: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(blocks, BS, kv_heads, d, generator=g) for name in ("k", "v")}


@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("length", [1, 5, 16, 37, 64, 65, 600])
@pytest.mark.parametrize("window", [None, 20])
def test_one_row_equals_the_traced_ops(built, d, length, window):
    layer = pool(48, 2, d, seed=length + d)
    g = torch.Generator().manual_seed(length)
    q = torch.randn(1, 6, d, generator=g)
    table = torch.randperm(48, generator=g)[:max(-(-length // BS), 2) + 1]  # padded past the length
    lens = torch.tensor([length], dtype=torch.int32)
    band = Band(window, None)
    want = traced.attend(layer, q, table, lens, d ** -0.5, band)
    got = cpu_attention.attend(layer, q, table, lens, d ** -0.5, band)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_a_batchs_rows_each_equal_the_traced_ops_and_an_empty_row_is_zeros(built):
    """Rows of a batched step (or a speculation check) over their own tables and lengths; a row of
    no positions (nothing the traced ops define: their softmax of nothing is NaN) gives zeros."""
    layer = pool(64, 3, 64, seed=3)
    g = torch.Generator().manual_seed(4)
    lengths = torch.tensor([1, 100, 640, 300, 17, 0], dtype=torch.int32)
    table = torch.stack([torch.randperm(64, generator=g)[:40] for _ in lengths]).int()  # converted to int64 by the op
    q = torch.randn(len(lengths), 9, 64, generator=g)
    want = traced.attend(layer, q, table, lengths, 0.125)
    got = torch.ops.kvchat.decode_attention(q, layer["k"], layer["v"], table, lengths, 0.125, 0)
    torch.testing.assert_close(got[:-1], want[:-1], atol=2e-6, rtol=1e-5)
    assert torch.isnan(want[-1]).all() and torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_a_batch_with_a_window_and_head_dim_96_equals_the_traced_ops(built):
    layer = pool(64, 2, 96, seed=8)
    g = torch.Generator().manual_seed(9)
    lengths = torch.tensor([300, 33, 129, 64], dtype=torch.int32)
    table = torch.stack([torch.randperm(64, generator=g)[:20] for _ in lengths])
    q = torch.randn(len(lengths), 8, 96, generator=g)
    band = Band(100, None)
    want = traced.attend(layer, q, table, lengths, 96 ** -0.5, band)
    got = cpu_attention.attend(layer, q, table, lengths, 96 ** -0.5, band)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_what_the_kernel_cannot_take_is_refused_not_misread(built):
    layer = pool(4, 2, 64, seed=10)
    q, table = torch.randn(1, 4, 64), torch.arange(4)
    with pytest.raises(ValueError, match="past a table of 4 blocks"):  # 65 positions in 4 blocks of 16
        torch.ops.kvchat.decode_attention(q, layer["k"], layer["v"], table, torch.tensor([65], dtype=torch.int32), 0.1, 0)
    with pytest.raises(ValueError, match="query"):  # 3 query heads over 2 KV heads
        torch.ops.kvchat.decode_attention(torch.randn(1, 3, 64), layer["k"], layer["v"], table,
                                          torch.tensor([9], dtype=torch.int32), 0.1, 0)
    with pytest.raises(ValueError, match="query"):  # a bf16 pool
        torch.ops.kvchat.decode_attention(q, layer["k"].bfloat16(), layer["v"].bfloat16(), table,
                                          torch.tensor([9], dtype=torch.int32), 0.1, 0)


def test_the_twin_serves_until_the_library_is_loaded(monkeypatch):
    layer = pool(8, 2, 64, seed=5)
    q, table, lens = torch.randn(1, 4, 64), torch.arange(8), torch.tensor([70], dtype=torch.int32)
    monkeypatch.setattr(int8_rows, "attention", None)
    got = cpu_attention.attend(layer, q, table, lens, 0.125, PLAIN)
    assert torch.equal(got, traced.attend(layer, q, table, lens, 0.125))


def test_the_compiled_step_calls_the_kernel_for_an_fp32_pool_without_a_soft_cap():
    layer = pool(4, 2, 64, seed=6)
    q = torch.randn(1, 4, 64)
    assert cpu_attention.takes(layer, q, PLAIN) == int8_rows.cpu_supported()
    assert cpu_attention.takes(layer, q, Band(32, None)) == int8_rows.cpu_supported()
    assert not cpu_attention.takes(layer, q, Band(None, 50.0))  # Gemma 2's soft cap stays traced
    assert not cpu_attention.takes({n: t.bfloat16() for n, t in layer.items()}, q.bfloat16(), PLAIN)
    assert not cpu_attention.takes(pool(4, 2, 36, seed=7), torch.randn(1, 4, 36), PLAIN)  # rows not 8-wide
