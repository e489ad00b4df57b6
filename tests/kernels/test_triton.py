"""Triton kernels against the torch reference: in the interpreter (TRITON_INTERPRET=1, set in
conftest before triton loads), or on CUDA when the suite runs with TRITON_INTERPRET=0 on a GPU
(``make gpu-check``). Inputs are made on the CPU; only the kernel runs on DEVICE."""
import os
from unittest import mock

import pytest
import torch

from kvchat.kernels import quant, reference, triton_decode, triton_kv
from kvchat.engine.kv.recent_window import RecentWindow

pytestmark = pytest.mark.gpu  # runs on CUDA where there is one: make gpu-check's kernel step

BS = 16
TRITON_FORMATS = list(quant.FORMATS)  # fp16, int8, fp8, k8v4, int4
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def on_device(x):
    if isinstance(x, dict):
        return {k: v.to(DEVICE) for k, v in x.items()}
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def assert_same_store(want: dict, got: dict, slots, fmt=None) -> None:
    """The reference's store, within the tolerance the README documents: the rotation's sums run in
    another order than torch's (on a GPU, and in the interpreter since the write kernel sums each
    tile's dot over D a slice at a time), so a value on a rounding edge may land one step away.
    Over the written slots, fewer than 1e-3 of the stored elements differ (codes and scales
    together, as ``kvchat bench kernels`` counts them); a code by one quantization step at most, a
    scale by one fp16 rounding; an fp8 code (``fmt``) by one e4m3 step, the next code of the same
    sign. Unquantized data (a copy) and every other slot: exact. int4's per-block key statistics:
    over the written blocks, a step code one code away at most, the minimum exact."""
    written = torch.zeros(want["k"].shape[0] * want["k"].shape[1], dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    blocks = torch.zeros(want["k"].shape[0], dtype=torch.bool)
    blocks[slots[slots >= 0].cpu() // want["k"].shape[1]] = True
    differing = total = 0
    for name, w in want.items():
        if fmt is not None and fmt.block_keys and name in ("k_scale", "k_zero"):
            w, g = w.cpu(), got[name].cpu()
            assert torch.equal(w[~blocks], g[~blocks]), f"{name}: a block that was not written changed"
            step = (w[blocks].int() - g[blocks].int()).abs().max() if name == "k_scale" else 0
            assert step <= 1 and (name == "k_scale" or torch.equal(w[blocks], g[blocks])), f"{name} moved"
            differing += (w[blocks] != g[blocks]).sum().item()
            total += w[blocks].numel()
            continue
        w, g = (t.flatten(0, 1) for t in (w, got[name].cpu()))
        assert torch.equal(w[~written], g[~written]), f"{name}: a slot that was not written changed"
        w, g = w[written], g[written]
        if fmt is not None and fmt.float8 and name in ("k", "v"):
            assert ((quant.fp8_order(w) - quant.fp8_order(g)).abs() <= 1).all(), \
                f"{name}: an fp8 code more than one step away"
        elif w.dtype in (torch.int8, torch.uint8):
            a, b = (quant.unpack_int4(t) if t.dtype == torch.uint8 else t for t in (w, g))
            assert (a.int() - b.int()).abs().max() <= 1, f"{name}: a code more than one step away"
        elif name.endswith("_scale"):
            assert torch.allclose(w.float(), g.float(), rtol=1e-3, atol=0), f"{name}: a scale moved"
        else:
            assert torch.equal(w, g), f"{name}: unquantized data is a copy"
        differing += (w != g).sum().item()
        total += w.numel()
    assert differing < 1e-3 * total, f"{differing} of {total} stored elements differ"


def scene(fmt, heads, kv_heads, head_dim, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lengths) + 3
    order = torch.randperm(num_blocks, generator=g)
    tables, used = [], 0
    for n in lengths:
        tables.append(order[used:used + -(-n // BS)])
        used += len(tables[-1])
    pool = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    rot = quant.hadamard(head_dim)
    center = torch.randn(kv_heads, head_dim, generator=g)
    cscale = torch.rand(kv_heads, head_dim, generator=g) + 0.5
    for table, n in zip(tables, lengths):
        k = torch.randn(n, kv_heads, head_dim, generator=g) * 2
        v = torch.randn(n, kv_heads, head_dim, generator=g)
        slots = table[torch.arange(n) // BS] * BS + torch.arange(n) % BS
        reference.write_kv(pool, fmt, k, v, slots, rot, center, cscale)
    return pool, tables, rot, center, cscale, g


@pytest.mark.parametrize("name", TRITON_FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_quantize_write_matches_the_reference_and_skips_padding(name, head_dim):
    fmt = quant.FORMATS[name]
    g = torch.Generator().manual_seed(head_dim)
    n, kv_heads, num_blocks = 21, 2, 4
    key = torch.randn(n, kv_heads, head_dim, generator=g) * 3
    value = torch.randn(n, kv_heads, head_dim, generator=g)
    slots = shuffled_slots(fmt, num_blocks, n, g)
    slots[[4, 11]] = -1
    rot, center = quant.hadamard(head_dim), torch.randn(kv_heads, head_dim, generator=g)
    cscale = torch.rand(kv_heads, head_dim, generator=g) + 0.5
    want = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    got = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    reference.write_kv(want, fmt, key, value, slots, rot, center, cscale)
    got = on_device(got)
    triton_kv.quantize_write(got, fmt, *(on_device(t) for t in (key, value, slots, rot, center, cscale)))
    assert_same_store(want, got, slots, fmt)


def shuffled_slots(fmt, num_blocks: int, n: int, g) -> torch.Tensor:
    """``n`` slots of the pool in random order; for int4's block keys, whose writes give each block
    from its first row (``quant.write``), blocks in random order filled in turn."""
    if not fmt.block_keys:
        return torch.randperm(num_blocks * BS, generator=g)[:n]
    blocks = torch.randperm(num_blocks, generator=g)
    return blocks[torch.arange(n) // BS] * BS + torch.arange(n) % BS


SENTINEL = {torch.int8: 77, torch.uint8: 0xA5, torch.float16: 1234.0, torch.float32: 12345.0}


def guarded_pool(fmt, num_blocks, kv_heads, head_dim, guard=4096):
    """A pool whose every tensor is a view into a larger buffer on DEVICE, all of it filled with a
    sentinel: a store that lands outside a live slot changes a byte the test can see, in the pool
    or in the guard on either side."""
    pool, buffers = {}, []
    for name, t in quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu").items():
        buf = torch.full((t.numel() + 2 * guard,), SENTINEL[t.dtype], dtype=t.dtype, device=DEVICE)
        pool[name] = buf[guard:guard + t.numel()].view(t.shape)
        buffers.append((name, buf, guard))
    return pool, buffers


@pytest.mark.parametrize("name", TRITON_FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_prefill_of_several_write_tiles_stores_every_token_and_nothing_else(name, head_dim):
    """40 tokens are three tiles of 16 (16 + 16 + 8) with padding slots in each. The slot and input
    rows past the 40th name real slots and hold real values: the last tile's rows past T, unmasked,
    would write them. Unnamed slots and the memory around the pool keep their sentinel. Compared
    with the reference as ``assert_same_store`` does."""
    fmt = quant.FORMATS[name]
    g = torch.Generator().manual_seed(head_dim + 1)
    n, kv_heads, num_blocks = 40, 2, 4
    key_buf = torch.randn(n + 8, kv_heads, head_dim, generator=g) * 3
    value_buf = torch.randn(n + 8, kv_heads, head_dim, generator=g)
    slot_buf = shuffled_slots(fmt, num_blocks, n + 8, g)
    padding = [3, 17, 18, 33]
    slot_buf[padding] = -1
    key, value, slots = key_buf[:n], value_buf[:n], slot_buf[:n]
    rot, center = quant.hadamard(head_dim), torch.randn(kv_heads, head_dim, generator=g)
    cscale = torch.rand(kv_heads, head_dim, generator=g) + 0.5
    want = {k: torch.full_like(t, SENTINEL[t.dtype])
            for k, t in quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu").items()}
    reference.write_kv(want, fmt, key, value, slots, rot, center, cscale)
    got, buffers = guarded_pool(fmt, num_blocks, kv_heads, head_dim)
    triton_kv.quantize_write(got, fmt, on_device(key_buf)[:n], on_device(value_buf)[:n], on_device(slot_buf)[:n],
                             *(on_device(t) for t in (rot, center, cscale)))
    assert_same_store(want, got, slots, fmt)  # the slots not written among them
    for pool_name, buf, guard in buffers:
        assert (buf[:guard] == SENTINEL[buf.dtype]).all() and (buf[-guard:] == SENTINEL[buf.dtype]).all(), pool_name


def padded_tables(tables, width=None, filler=None):
    """The tables as one int32 ``[B, width]``; past each sequence's blocks, ``filler`` (other
    sequences' real block ids, as a captured step's padded bucket holds) or zeros."""
    width = width or max(len(t) for t in tables)
    rows = []
    for t in tables:
        pad = filler[:width - len(t)] if filler is not None else t.new_zeros(width - len(t))
        rows.append(torch.cat([t, pad]))
    return torch.stack(rows).to(torch.int32)


def decode(query, pool, fmt, table, lengths, rot, cscale, **kwargs):
    return triton_decode.paged_decode(on_device(query), on_device(pool), fmt, on_device(table),
                                  on_device(torch.tensor(lengths, dtype=torch.int32)), query.shape[-1] ** -0.5,
                                  on_device(rot), on_device(cscale if fmt.quantized else None), **kwargs).cpu()


GROUPS = [1, 4, 7, 8]  # GQA groups: MHA, Llama-3 8B, Qwen2.5-7B (28/4), and a full 8 (no padding below 16)


@pytest.mark.parametrize("name", TRITON_FORMATS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", GROUPS)
def test_paged_decode_matches_reference(name, head_dim, group):
    """Two sequences of odd lengths in random, non-contiguous blocks: 37 tokens (part of one
    tile) and 211 (four tiles, the last partial), split three ways, so that splits hold one tile,
    two, or none, and the merge sees empty parts."""
    fmt = quant.FORMATS[name]
    kv_heads = 2
    heads = kv_heads * group
    lengths = [37, 211]
    pool, tables, rot, center, cscale, g = scene(fmt, heads, kv_heads, head_dim, lengths, seed=group + head_dim)
    query = torch.randn(len(lengths), heads, head_dim, generator=g)
    out = decode(query, pool, fmt, padded_tables(tables), lengths, rot, cscale, splits=3)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        want = reference.paged_attention(query[i:i + 1], pool, fmt, table, n, head_dim ** -0.5, None, rot,
                                         cscale if fmt.quantized else None)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["int4", "fp8"])  # tiles of 64 and of 32
@pytest.mark.parametrize("splits", [1, 2, 5, 40])
def test_the_split_count_and_a_padded_table_leave_the_result_alone(name, splits):
    """A captured step launches a fixed split count over a table padded to its bucket with stale
    ids of other blocks: each program finds its share from the length it reads, so 1 split or
    more splits than tiles (40 for 4 or 7 tiles: most programs see nothing) give the same answer."""
    fmt = quant.FORMATS[name]
    lengths = [211]
    pool, (table, _), rot, center, cscale, g = scene(fmt, 8, 2, 64, lengths + [90], seed=splits)
    query = torch.randn(1, 8, 64, generator=g)
    filler = torch.arange(pool["k"].shape[0] - 1, -1, -1)
    out = decode(query, pool, fmt, padded_tables([table], width=64, filler=filler), lengths, rot, cscale,
                 splits=splits)
    want = reference.paged_attention(query, pool, fmt, table, 211, 64 ** -0.5, None, rot, cscale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_the_split_count_follows_the_sms_not_the_bucket():
    """Buckets of 8,192 and 32,768 blocks launch the same programs on an H200 (132 SMs): the
    padding of a large bucket costs no programs. A short table launches no more splits than it
    has tiles."""
    big = [triton_decode.decode_splits(132, 1, 8, blocks * BS) for blocks in (2048, 8192, 32768)]
    assert big[0] == big[1] == big[2] == -(-132 * triton_decode.PROGRAMS_PER_SM // 8)
    assert triton_decode.decode_splits(132, 1, 8, 32 * BS) == 32 * BS // triton_decode.DECODE_TILE
    assert triton_decode.decode_splits(132, 1, 8, 1) == 1
    assert triton_decode.decode_splits(132, 1, 8, 32 * BS, tile=32) == 32 * BS // 32  # fp8's tiles


@pytest.mark.parametrize("name", TRITON_FORMATS[1:])
@pytest.mark.parametrize("head_dim, group", [(64, 1), (128, 4), (64, 7), (128, 8)])
@pytest.mark.parametrize("window_len", [5, 66])  # a part of the context; all but the sinks
def test_paged_decode_with_a_full_precision_window_matches_reference(name, head_dim, group, window_len):
    """The kernel reads the window's rows itself (one more program per KV head, a block's worth
    of rows at a time), from the positions its bounds name; the reference gathers the same rows."""
    _window_case(quant.FORMATS[name], head_dim, group, window_len, n=70)


@pytest.mark.parametrize("window_len", [14, 70])  # a ring of less than one chunk; every position held
def test_paged_decode_with_a_window_of_other_sizes_matches_reference(window_len):
    _window_case(quant.FORMATS["int4"], 64, 4, window_len, n=70)


BANDS = [reference.Band(40), reference.Band(None, 20.0), reference.Band(100, 30.0)]


@pytest.mark.parametrize("name", TRITON_FORMATS)
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("head_dim", [64, 256])  # 256: Gemma's, read in tiles of half the tokens
def test_paged_decode_with_a_sliding_window_and_a_soft_cap_matches_reference(name, band, head_dim):
    """A window of 40 hides most of the 211-token sequence and none of the 37-token one; the
    tiles start at the window's first position. Queries scaled 4x make the scores large enough
    that a cap of 20 changes them."""
    fmt = quant.FORMATS[name]
    lengths = [37, 211]
    pool, tables, rot, center, cscale, g = scene(fmt, 8, 2, head_dim, lengths, seed=7)
    query = 4 * torch.randn(len(lengths), 8, head_dim, generator=g)
    out = decode(query, pool, fmt, padded_tables(tables), lengths, rot, cscale, splits=3, band=band)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        want = reference.paged_attention(query[i:i + 1], pool, fmt, table, n, head_dim ** -0.5, None, rot,
                                         cscale if fmt.quantized else None, band=band)
        plain = reference.paged_attention(query[i:i + 1], pool, fmt, table, n, head_dim ** -0.5, None, rot,
                                          cscale if fmt.quantized else None)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=1e-4)
        assert band.changes(n) == ((want - plain).abs().max().item() > 1e-3)  # the band is not a no-op


@pytest.mark.parametrize("name", TRITON_FORMATS[1:])
@pytest.mark.parametrize("band, window_len", [(reference.Band(20), 66), (reference.Band(68, 30.0), 66),
                                              (reference.Band(40), 16)], ids=str)
def test_a_sliding_window_over_the_full_precision_rows_matches_reference(name, band, window_len):
    """With the window's rows: a sliding window of 20 hides the sinks and the ring's oldest rows;
    one of 68 hides two of the four sinks; one of 40 over a ring of 16 starts in the pool's rows,
    between the sinks and the ring, as a real model's window of thousands does."""
    _window_case(quant.FORMATS[name], 64, 4, window_len, n=70, band=band)


def _window_case(fmt, head_dim, group, window_len, n, band=reference.PLAIN):
    kv_heads = 2
    heads = kv_heads * group
    pool, (table,), rot, center, cscale, g = scene(fmt, heads, kv_heads, head_dim, [n], seed=window_len + group)
    query = torch.randn(1, heads, head_dim, generator=g)
    sinks = min(4, n - window_len)  # with every position in the window, there is nothing to sink
    recent = RecentWindow(1, kv_heads, head_dim, torch.float32, "cpu", size=window_len, sinks=sinks)
    recent.store(0, 0, torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g))
    s, first = recent.bounds(0, n)
    window = (on_device(recent.k[0]), on_device(recent.v[0]), sinks,
              on_device(torch.tensor([s, first, -1], dtype=torch.int32)))
    out = decode(query, pool, fmt, table[None].to(torch.int32), [n], rot, cscale, splits=2, window=window, band=band)
    want = reference.paged_attention(query, pool, fmt, table, n, head_dim ** -0.5, None, rot, cscale,
                                     window=recent.rows(0, n), band=band)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_the_gpu_bench_check_runs_and_agrees():
    """``kvchat bench kernels``' correctness part, here in the interpreter on a short context, so that
    its first run on a GPU is not its first run."""
    from kvchat.bench import kernels as bench_kernels

    rows = bench_kernels.check(torch.device(DEVICE), dtype=torch.float32, length=40)
    assert [r["precision"] for r in rows] == ["fp16", "int8", "fp8", "k8v4", "int4"]
    for r in rows:
        assert r["decode_max_abs_err"] < 1e-5
        assert r.get("write_bytes_differing", 0) < 1e-3 and r.get("write_max_steps", 0) <= 1.0


@pytest.mark.parametrize("name, block_size, head_dim, problem", [
    ("fp16", 24, 64, "block size 24 is not a power of two"),
    ("fp16", 16, 96, "head_dim 96 is not a power of two"),
    ("int8", 16, 32, "head_dim 32 is below 64"),
])
def test_shapes_the_kernels_cannot_take_get_a_clear_error_and_the_reference_path(name, block_size, head_dim,
                                                                                   problem):
    """A Triton compile error deep in a reply would be the first a user heard of it."""
    from kvchat.kernels import dispatch

    fmt = quant.FORMATS[name]
    assert problem in triton_kv.unsupported(fmt, block_size, head_dim)
    pool = quant.layer_tensors(fmt, 4, block_size, 2, head_dim, torch.float32, "cpu")
    rot = quant.hadamard(head_dim) if fmt.quantized else None
    x = torch.randn(3, 2, head_dim)
    with pytest.raises(ValueError, match=problem):
        triton_kv.quantize_write(pool, fmt, x, x, torch.arange(3), rot)
    with pytest.raises(ValueError, match=problem):
        triton_decode.paged_decode(torch.randn(1, 4, head_dim), pool, fmt, torch.zeros(1, 1, dtype=torch.int32),
                               torch.tensor([3], dtype=torch.int32), 0.1, rot)
    cuda_like = mock.Mock(is_cuda=True, shape=x.shape)
    assert not dispatch.use_triton(cuda_like, pool, fmt)
    ok = quant.layer_tensors(fmt, 4, 16, 2, 64, torch.float32, "cpu")
    assert dispatch.use_triton(mock.Mock(is_cuda=True, shape=(3, 2, 64)), ok, fmt)


def test_the_decode_kernel_is_specialized_on_nothing_that_grows_with_the_context():
    """``SPLITS`` was a constexpr: every 128 tokens of context compiled the kernel again, a stall
    mid-reply. Two lengths launch with the same constants, and the integers that differ are all
    kept out of Triton's specialization."""
    import inspect

    fmt = quant.FORMATS["int8"]
    launches = []
    real = triton_decode._paged_decode_kernel

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **constants):
                launches.append((args, constants))
                return real[grid](*args, **constants)
            return launch

    names = list(inspect.signature(real.fn).parameters)
    with mock.patch.object(triton_decode, "_paged_decode_kernel", Recorder()):
        for n in (20, 150):
            pool, (table,), rot, _, cscale, g = scene(fmt, 4, 2, 64, [n], seed=n)
            triton_decode.paged_decode(torch.randn(1, 4, 64, generator=g), pool, fmt, table[None].to(torch.int32),
                                   torch.tensor([n], dtype=torch.int32), 0.125, rot, cscale)
    (a, ca), (b, cb) = launches
    assert ca == cb
    varying = {names[i] for i, (x, y) in enumerate(zip(a, b)) if isinstance(x, int) and x != y}
    assert varying == {"table_stride", "splits"}
    listed = real.kwargs["do_not_specialize"] if hasattr(real, "kwargs") else real.do_not_specialize  # interpreted
    unspecialized = {names[d] if isinstance(d, int) else d for d in listed}
    assert varying <= unspecialized


@pytest.mark.parametrize("precision", ["k8v4", "int8", "fp8"])
def test_the_write_kernel_puts_a_decode_token_in_the_window_ring_or_nowhere(precision):
    """Row ``wmeta[2]`` of the ring gets the token's transformed row as it was before rounding;
    -1 (a captured step's warm-up) writes no row. Each stored width's variant (int8 keys with int4
    values, int8's, fp8's)."""
    fmt = quant.FORMATS[precision]
    pool, _, rot, center, cscale, g = scene(fmt, 4, 2, 64, [20], seed=3)
    key, value = torch.randn(1, 2, 64, generator=g), torch.randn(1, 2, 64, generator=g)
    for row in (-1, 9):
        ring_k, ring_v = torch.zeros(12, 2, 64), torch.zeros(12, 2, 64)
        wmeta = torch.tensor([0, 0, row], dtype=torch.int32)
        got = [on_device(t) for t in (ring_k, ring_v)]
        triton_kv.quantize_write(on_device(pool), fmt, on_device(key), on_device(value), on_device(torch.tensor([21])),
                                 on_device(rot), on_device(center), on_device(cscale), (*got, on_device(wmeta)))
        ring_k, ring_v = (t.cpu() for t in got)
        if row < 0:
            assert not ring_k.any() and not ring_v.any()
            continue
        torch.testing.assert_close(ring_k[row], quant.transform_keys(key, rot, center, cscale)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ring_v[row], quant.rotate(value, rot)[0], atol=1e-5, rtol=1e-5)
        assert not ring_k[:row].any() and not ring_k[row + 1:].any()


_COMPILE_WRITE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from kvchat.kernels import triton_kv

consts = dict(KV_HEADS=8, D=128, BITS=4, HAS_CENTER=True, GROUP=32, CLIP=True, RING=True,
              BLOCK_T=triton_kv.WRITE_TILE, BLOCK_K=triton_kv.WRITE_K, FP8=False)
sig = {"x_ptr": "*bf16", "slot_ptr": "*i64", "center_ptr": "*fp32", "cscale_ptr": "*fp32", "rot_ptr": "*fp32",
       "data_ptr": "*u8", "scale_ptr": "*fp16", "ring_ptr": "*bf16", "wmeta_ptr": "*i32", "n": "i32",
       "x_stride_t": "i32", "x_stride_h": "i32", **{k: "constexpr" for k in consts}}
for cap in (86, 90):
    src = triton.compiler.ASTSource(fn=triton_kv._quantize_write_kernel, signature=sig, constexprs=consts)
    ptx = triton.compile(src, target=GPUTarget("cuda", cap, 32)).asm["ptx"]
    print(cap, "tf32" in ptx, "mma" in ptx, ptx.count("fma.rn.f32"))
"""


def test_the_write_kernel_compiles_for_cuda_to_fp32_fmas_not_tf32():
    """The interpreter's dot is a numpy matmul whatever ``input_precision`` says, so only the
    compiled kernel shows it: without "ieee" an fp32 tl.dot becomes TF32 tensor-core MMAs on a GPU
    (10-bit mantissa), and the rotated values would miss the reference's by far more than a
    rounding edge. Compiled to PTX for sm_86 and sm_90 without a GPU, in a fresh process with the
    interpreter off."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": os.environ["KVCHAT_TEST_TRITON_CACHE"]}
    done = subprocess.run([sys.executable, "-c", _COMPILE_WRITE], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[0] for line in lines] == ["86", "90"]
    for cap, tf32, mma, fmas in lines:
        assert tf32 == "False" and mma == "False" and int(fmas) > 0, (cap, tf32, mma, fmas)


def test_the_decode_products_take_exact_fp16_codes_and_an_unquantized_pool_as_it_is(monkeypatch):
    """On a GPU: int8/int4 codes go into the products as fp16 (exact), a bf16 window's rows as
    bf16, a bf16 pool as bf16; anything fp32 stays fp32 with "ieee" (TF32 would round it). Under
    the interpreter everything is fp32."""
    import triton.language as tl

    bf16 = {"k": torch.zeros(1, dtype=torch.bfloat16)}
    fp32 = {"k": torch.zeros(1)}
    assert triton_decode.dot_dtypes(bf16, quant.FORMATS["int4"], torch.bfloat16) == (tl.float32, tl.float32, "ieee")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_decode.dot_dtypes(bf16, quant.FORMATS["fp16"]) == (tl.bfloat16, tl.bfloat16, "tf32")
    assert triton_decode.dot_dtypes(bf16, quant.FORMATS["int4"], torch.bfloat16) == (tl.float16, tl.bfloat16, "tf32")
    assert triton_decode.dot_dtypes(bf16, quant.FORMATS["k8v4"]) == (tl.float16, tl.float16, "tf32")
    assert triton_decode.dot_dtypes(fp32, quant.FORMATS["fp16"]) == (tl.float32, tl.float32, "ieee")
    assert triton_decode.dot_dtypes(bf16, quant.FORMATS["int8"], torch.float32) == (tl.float32, tl.float32, "ieee")
