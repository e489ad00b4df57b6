"""The CPU's traced decode attention against its twin, the torch reference: the same pool after the
write, the same output from a block table padded past the length."""
import pytest
import torch

from kvchat.kernels import quant, reference, traced

FP = quant.FORMATS["fp16"]
BS, BLOCKS, KV_HEADS, D = 16, 12, 2, 64


def sequence(length: int, heads: int, seed: int):
    """A pool holding ``length - 1`` tokens over a scrambled table, and the last token's K/V and
    query, as a decode step finds them."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(length, KV_HEADS, D, generator=g) for _ in range(2))
    q = torch.randn(1, heads, D, generator=g)
    table = torch.randperm(BLOCKS, generator=g)
    slots = table[torch.arange(length) // BS] * BS + torch.arange(length) % BS
    pool = quant.layer_tensors(FP, BLOCKS, BS, KV_HEADS, D, torch.float32, "cpu")
    reference.write_kv(pool, FP, k[:-1], v[:-1], slots[:-1], None)
    return pool, k[-1:], v[-1:], q, table, slots[-1:]


@pytest.mark.parametrize("heads", [2, 6])
@pytest.mark.parametrize("length", [1, 5, 16, 37, 60])
def test_traced_step_writes_and_attends_as_the_reference_does(heads, length):
    pool, k, v, q, table, slot = sequence(length, heads, seed=length + heads)
    theirs = {name: t.clone() for name, t in pool.items()}
    reference.write_kv(theirs, FP, k, v, slot, None)
    want = reference.paged_attention(q, theirs, FP, table[:-(-length // BS)], length, D ** -0.5)
    traced.write(pool, k, v, slot)
    got = traced.attend(pool, q, table, torch.tensor([length], dtype=torch.int32), D ** -0.5)  # all 12 blocks
    for name, t in theirs.items():
        assert torch.equal(pool[name], t), name
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_slot_minus_one_writes_nothing():
    """A warm-up step writes to slot -1: no branch skips the write, so it must leave the pool as
    it was."""
    pool, k, v, _, _, _ = sequence(20, 2, seed=1)
    before = {name: t.clone() for name, t in pool.items()}
    traced.write(pool, k + 100, v + 100, torch.tensor([-1]))
    for name, t in before.items():
        assert torch.equal(pool[name], t), name


@pytest.mark.parametrize("band", [reference.PLAIN, reference.Band(24, 2.0)], ids=str)
def test_a_batch_of_sequences_writes_and_attends_each_as_the_reference_does(band):
    """Rows of a batched step: each its own block table (padded to the widest), length and slot,
    all in one pool; each row's output is the reference's for that sequence alone. With a band (a
    window of 24 and a cap of 2), rows longer and shorter than the window."""
    lengths, heads = [5, 37, 16, 60], 6
    g = torch.Generator().manual_seed(7)
    pool = quant.layer_tensors(FP, 4 * BLOCKS, BS, KV_HEADS, D, torch.float32, "cpu")
    theirs = {name: t.clone() for name, t in pool.items()}
    tables, ks, vs, qs, slots = [], [], [], [], []
    for i, length in enumerate(lengths):  # sequence i owns blocks i*12 .. i*12+11, scrambled
        k, v = (torch.randn(length, KV_HEADS, D, generator=g) for _ in range(2))
        table = torch.randperm(BLOCKS, generator=g) + i * BLOCKS
        slot = table[torch.arange(length) // BS] * BS + torch.arange(length) % BS
        for p in (pool, theirs):
            reference.write_kv(p, FP, k[:-1], v[:-1], slot[:-1], None)
        reference.write_kv(theirs, FP, k[-1:], v[-1:], slot[-1:], None)
        tables.append(table)
        ks.append(k[-1:]), vs.append(v[-1:]), slots.append(slot[-1:])
        qs.append(torch.randn(1, heads, D, generator=g))
    traced.write(pool, torch.cat(ks), torch.cat(vs), torch.cat(slots))
    got = traced.attend(pool, torch.cat(qs), torch.stack(tables), torch.tensor(lengths, dtype=torch.int32), D ** -0.5,
                        band)
    for name, t in theirs.items():
        assert torch.equal(pool[name], t), name
    for i, length in enumerate(lengths):
        want = reference.paged_attention(qs[i], theirs, FP, tables[i][:-(-length // BS)], length, D ** -0.5,
                                         band=band)
        torch.testing.assert_close(got[i:i + 1], want, atol=2e-6, rtol=1e-5)
