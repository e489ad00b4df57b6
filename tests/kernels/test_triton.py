"""Triton kernels against the torch reference: in the interpreter (TRITON_INTERPRET=1, set in
conftest before triton loads), or on CUDA when the suite runs with TRITON_INTERPRET=0 on a GPU
(``make gpu-check``). Inputs are made on the CPU; only the kernel runs on DEVICE."""
import os

import pytest
import torch

from kvchat.kernels import quant, reference, triton_kv

BS = 16
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def on_device(x):
    if isinstance(x, dict):
        return {k: v.to(DEVICE) for k, v in x.items()}
    return x.to(DEVICE) if isinstance(x, torch.Tensor) else x


def assert_same_store(want: dict, got: dict, fmt) -> None:
    """Byte-exact in the interpreter. On a GPU the rotation's sums run in another order than
    torch's, so a value on a rounding edge may land one step away: at most 1% of them."""
    for name, w in want.items():
        g = got[name].cpu()
        if DEVICE == "cpu" or w.dtype not in (torch.int8, torch.uint8):
            close = torch.equal(w, g) if DEVICE == "cpu" else torch.allclose(w.float(), g.float(), atol=1e-3, rtol=1e-3)
            assert close, name
            continue
        a, b = (quant.unpack_int4(t) if t.dtype == torch.uint8 else t for t in (w, g))
        steps = (a.int() - b.int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() <= 0.01, name


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


@pytest.mark.parametrize("name", ["fp16", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_fused_quantize_write_is_byte_exact_and_skips_padding(name, head_dim):
    fmt = quant.FORMATS[name]
    g = torch.Generator().manual_seed(head_dim)
    n, kv_heads, num_blocks = 21, 2, 4
    key = torch.randn(n, kv_heads, head_dim, generator=g) * 3
    value = torch.randn(n, kv_heads, head_dim, generator=g)
    slots = torch.randperm(num_blocks * BS, generator=g)[:n]
    slots[[4, 11]] = -1
    rot, center = quant.hadamard(head_dim), torch.randn(kv_heads, head_dim, generator=g)
    cscale = torch.rand(kv_heads, head_dim, generator=g) + 0.5
    want = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    got = quant.layer_tensors(fmt, num_blocks, BS, kv_heads, head_dim, torch.float32, "cpu")
    reference.write_kv(want, fmt, key, value, slots, rot, center, cscale)
    got = on_device(got)
    triton_kv.quantize_write(got, fmt, *(on_device(t) for t in (key, value, slots, rot, center, cscale)))
    assert_same_store(want, got, fmt)


@pytest.mark.parametrize("name", ["fp16", "int8", "k8v4", "int4"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 4, 64), (8, 2, 64), (9, 3, 64), (8, 1, 128)])  # 9/3: the starter's group of 3, padded to 4 in the kernel
def test_paged_decode_matches_reference(name, heads, kv_heads, head_dim):
    fmt = quant.FORMATS[name]
    lengths = [37, 70]  # not multiples of the block size; the second spans three splits
    pool, tables, rot, center, cscale, g = scene(fmt, heads, kv_heads, head_dim, lengths, seed=heads + head_dim)
    query = torch.randn(len(lengths), heads, head_dim, generator=g)
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables]).to(torch.int32)
    scale_vec = cscale if fmt.quantized else None
    out = triton_kv.paged_decode(on_device(query), on_device(pool), fmt, on_device(padded),
                                 on_device(torch.tensor(lengths, dtype=torch.int32)), head_dim ** -0.5, on_device(rot),
                                 on_device(scale_vec), blocks_per_split=2).cpu()
    for i, (table, n) in enumerate(zip(tables, lengths)):
        want = reference.paged_attention(query[i:i + 1], pool, fmt, table, n, head_dim ** -0.5, None, rot, scale_vec)
        torch.testing.assert_close(out[i:i + 1], want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("window_len", [5, 14, 66, 70])  # a part; a part; all but the sinks; all
def test_paged_decode_with_a_full_precision_window_matches_reference(name, window_len):
    fmt = quant.FORMATS[name]
    heads, kv_heads, head_dim, n = 8, 2, 64, 70
    pool, (table,), rot, center, cscale, g = scene(fmt, heads, kv_heads, head_dim, [n], seed=window_len)
    query = torch.randn(1, heads, head_dim, generator=g)
    sinks = min(4, n - window_len)  # with every position in the window, there is nothing to sink
    rows = (sinks, n - window_len, torch.randn(sinks + window_len, kv_heads, head_dim, generator=g),
            torch.randn(sinks + window_len, kv_heads, head_dim, generator=g))
    out = triton_kv.paged_decode(on_device(query), on_device(pool), fmt, on_device(table[None].to(torch.int32)),
                                 on_device(torch.tensor([n], dtype=torch.int32)), head_dim ** -0.5, on_device(rot),
                                 on_device(cscale), blocks_per_split=2,
                                 window=tuple(on_device(t) for t in rows)).cpu()
    want = reference.paged_attention(query, pool, fmt, table, n, head_dim ** -0.5, None, rot, cscale, window=rows)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_the_gpu_bench_check_runs_and_agrees():
    """``kvchat bench kernels``' correctness part, here in the interpreter on a short context, so that
    its first run on a GPU is not its first run."""
    from kvchat.kernels import bench_kernels

    rows = bench_kernels.check(torch.device(DEVICE), dtype=torch.float32, length=40)
    assert [r["precision"] for r in rows] == ["fp16", "int8", "k8v4", "int4"]
    for r in rows:
        assert r["decode_max_abs_err"] < 1e-5
        assert r.get("write_bytes_differing", 0) < 1e-3 and r.get("write_max_steps", 0) <= 1.0
