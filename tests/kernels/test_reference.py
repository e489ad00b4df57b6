"""The torch reference against plain attention on unpaged tensors."""
import math

import pytest
import torch

from kvchat.kernels import quant, reference

FP = quant.FORMATS["fp16"]


def naive(q, k, v, scale):
    """q [T, H, D] the last T of k/v [L, Hkv, D], causal, GQA by repetition."""
    t, h, _ = q.shape
    length, hkv, _ = k.shape
    k = k.repeat_interleave(h // hkv, dim=1)
    v = v.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, k) * scale
    pos = torch.arange(length - t, length)[:, None]
    scores = scores.masked_fill(torch.arange(length)[None, :] > pos, float("-inf"))
    return torch.einsum("htl,lhd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 64), (16, 2, 128)])
@pytest.mark.parametrize("length, q_len", [(1, 1), (37, 1), (37, 5), (64, 64), (50, 13)])
def test_paged_attention_matches_naive_on_a_scrambled_block_table(heads, kv_heads, head_dim, length, q_len):
    g = torch.Generator().manual_seed(length * 31 + q_len)
    bs, num_blocks = 16, 12
    k = torch.randn(length, kv_heads, head_dim, generator=g)
    v = torch.randn(length, kv_heads, head_dim, generator=g)
    q = torch.randn(q_len, heads, head_dim, generator=g)
    table = torch.randperm(num_blocks, generator=g)[:math.ceil(length / bs)]
    slots = (table[torch.arange(length) // bs] * bs + torch.arange(length) % bs)
    pool = quant.layer_tensors(FP, num_blocks, bs, kv_heads, head_dim, torch.float32, "cpu")
    reference.write_kv(pool, FP, k, v, slots, None)
    out = reference.paged_attention(q, pool, FP, table, length, head_dim ** -0.5)
    torch.testing.assert_close(out, naive(q, k, v, head_dim ** -0.5), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("fold", [False, True])
def test_causal_attention_with_folded_query_groups_matches_naive(fold):
    """CUDA's path for a masked chunk folds each KV head's query heads into its rows; the CPU's
    passes the groups to SDPA. Both against plain attention."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((13, 12, 64), (50, 4, 64), (50, 4, 64)))
    out = reference.causal_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), 0.125, fold_groups=fold)
    torch.testing.assert_close(out[0].transpose(0, 1), naive(q, k, v, 0.125), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_a_long_context_is_dequantized_in_slices_to_the_same_rows(name, monkeypatch):
    fmt = quant.FORMATS[name]
    g = torch.Generator().manual_seed(7)
    pool = quant.layer_tensors(fmt, 8, 16, 2, 64, torch.float32, "cpu")
    k = torch.randn(100, 2, 64, generator=g)
    table = torch.randperm(8, generator=g)[:7]
    slots = table[torch.arange(100) // 16] * 16 + torch.arange(100) % 16
    reference.write_kv(pool, fmt, k, k, slots, quant.hadamard(64))
    whole = quant.read(pool, fmt, "k", table, 100, None, torch.float32)
    monkeypatch.setattr(reference, "READ_SLICE", 24)  # not a multiple of the block size
    sliced = reference.sequence_rows(pool, fmt, "k", table, 100, None, torch.float32, None, None, 64)
    assert torch.equal(sliced, whole)


def test_consecutive_table_is_a_view_with_the_same_result():
    torch.manual_seed(0)
    pool = {"k": torch.randn(8, 16, 2, 64), "v": torch.randn(8, 16, 2, 64)}
    q = torch.randn(1, 4, 64)
    table = torch.tensor([3, 4, 5])
    assert reference.consecutive_start([3, 4, 5]) == 3 and reference.consecutive_start([3, 5, 4]) is None
    a = reference.paged_attention(q, pool, FP, table, 40, 0.125)
    b = reference.paged_attention(q, pool, FP, table, 40, 0.125, first_block=3)
    assert torch.equal(a, b)
    assert quant.gather(pool["k"], table, 40, 3).data_ptr() == pool["k"][3].data_ptr()


def test_padding_slots_are_not_written():
    pool = {"k": torch.zeros(2, 4, 1, 2), "v": torch.zeros(2, 4, 1, 2)}
    key = torch.ones(3, 1, 2)
    reference.write_kv(pool, FP, key, key * 2, torch.tensor([5, -1, 0]), None)
    assert pool["k"].flatten(0, 1)[:, 0, 0].tolist() == [1, 0, 0, 0, 0, 1, 0, 0]
    assert pool["v"].flatten(0, 1)[:, 0, 0].tolist() == [2, 0, 0, 0, 0, 2, 0, 0]
