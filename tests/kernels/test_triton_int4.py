"""int4's block keys in Triton (kernels/triton_int4.py) against the torch reference (int4.py): a
prefill's write, a decode token's write with its block's earlier rows from the window's ring or,
where the window does not hold them, from the pool, and the read of a prefill's past."""
import os
from unittest import mock

import pytest
import torch

from kvchat.core.kv_sizes import KVShape
from kvchat.engine.kv.cache import KVCache
from kvchat.kernels import dispatch, int4, quant, triton_int4
from kvchat.engine.kv.recent_window import RecentWindow

pytestmark = pytest.mark.gpu  # runs on CUDA where there is one: make gpu-check's kernel step

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
FMT = quant.FORMATS["int4"]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_prefill_write_and_its_read_back_match_the_reference(head_dim):
    g = torch.Generator().manual_seed(head_dim)
    n, kv_heads = 40, 2
    keys = torch.randn(n, kv_heads, head_dim, generator=g) * 3 + 5
    keys[..., 7] *= 30  # an outlier channel
    slots = 16 + torch.arange(n)  # blocks 1, 2 and half of 3, each from its first row
    slots[9] = -1  # padding: left out of its block's statistics
    want = quant.layer_tensors(FMT, 5, 16, kv_heads, head_dim, torch.float32, "cpu")
    int4.write_block_keys(want, keys[slots >= 0], slots[slots >= 0], None)
    got = {k: t.to(DEVICE) for k, t in quant.layer_tensors(FMT, 5, 16, kv_heads, head_dim, torch.float32, "cpu").items()}
    triton_int4.write_block_keys(got, keys.to(DEVICE), slots.to(DEVICE))
    for name in ("k", "k_scale", "k_zero"):
        w, x = want[name], got[name].cpu()
        if name == "k_scale":  # a step's division may round otherwise on a GPU: one code at most
            assert (w.int() - x.int()).abs().max() <= 1
        else:
            assert (w != x).sum() <= (1e-3 * w.numel() if name == "k" else 0), name
    table = torch.tensor([1, 2, 3], dtype=torch.int32, device=DEVICE)
    out = torch.zeros(n - 5, kv_heads, head_dim, device=DEVICE)
    triton_int4.dequantize_block_keys(got, table, 5, n - 5, out)  # from inside a block
    ref = quant.read({k: t.cpu() for k, t in got.items()}, FMT, "k", table.long().cpu(), n, None, torch.float32)
    torch.testing.assert_close(out.cpu(), ref[5:], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("window_from", [0, 21])
def test_decode_tokens_written_one_by_one_match_the_reference(window_from):
    """Each token's block is quantized again from its first row. From the start, the window's ring
    holds the earlier rows (the kernel reads them there, as a captured step must); a window begun
    at position 21 does not hold block 1's first five, which both read back from the pool."""
    shape, n = KVShape(num_layers=1, num_kv_heads=2, head_dim=64), 40
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(n, 2, 64, generator=g) * 3, torch.randn(n, 2, 64, generator=g)
    k[..., 5] += 40
    slots = torch.arange(16, 16 + n)
    pools = []
    for triton in (False, True):
        dev = DEVICE if triton else "cpu"
        kv = KVCache(shape, 4, 16, torch.float32, dev, "int4")
        window = RecentWindow(1, 2, 64, torch.float32, dev)
        with mock.patch.object(dispatch, "use_triton", lambda *args, on=triton: on):
            for p in range(n):
                kv.write(0, k[p:p + 1].to(dev), v[p:p + 1].to(dev), slots[p:p + 1].to(dev),
                         window if p >= window_from else None, p)
        pools.append((kv.layers[0], window))
    (want, want_window), (got, got_window) = pools
    for name in want:
        differ = (want[name] != got[name].cpu()).sum().item()
        assert differ <= (0 if DEVICE == "cpu" else 1e-3 * want[name].numel()), (name, differ)
    torch.testing.assert_close(got_window.k.cpu(), want_window.k, atol=1e-5, rtol=1e-6)
