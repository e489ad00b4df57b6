"""convert.converted: a transaction in bounded slices."""
from unittest import mock

import pytest
import torch

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.convert import converted
from kvchat.core.kv_sizes import SLICE_BLOCKS, KVShape
from kvchat.core.memory import slice_bytes
from kvchat.engine.tensor_peak import TensorPeak
from kvchat.kernels import quant

SHAPE = KVShape(num_layers=2, num_kv_heads=8, head_dim=128)  # an 8B model's K/V heads
STATS = ([torch.zeros(8, 128)] * 2, [torch.ones(8, 128)] * 2, [torch.full((2, 8), 0.05)] * 2)


def filled(precision: str, num_blocks: int) -> KVCache:
    kv = KVCache(SHAPE, num_blocks, 16, torch.float32, "cpu", precision)
    kv.calibrated(*STATS)
    slots = torch.arange(num_blocks * 16)
    gen = torch.Generator().manual_seed(0)
    for layer in range(SHAPE.num_layers):
        k, v = (torch.randn(len(slots), 8, 128, generator=gen) for _ in range(2))
        kv.write(layer, k, v, slots)
    return kv


def snapshot(kv: KVCache) -> list[dict]:
    return [{name: t.clone() for name, t in layer.items()} for layer in kv.layers]


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [("fp16", "int8"), ("int8", "int4"), ("int4", "fp16")])
def test_working_memory_is_one_slice_whatever_the_pool_size(source, target):
    """Before slicing, a layer was converted whole in fp32: the working set grew with the pool
    (8.5x a layer's K+V). Now it is one slice's, and the planner's ``slice_bytes`` covers it."""
    working = []
    for blocks in (SLICE_BLOCKS * 2, SLICE_BLOCKS * 4):
        kv = filled(source, blocks)
        with TensorPeak() as peak:
            new = converted(kv, target, blocks, *STATS)
        working.append(peak.peak - new.nbytes)
    assert working[1] <= working[0] * 1.05
    assert working[0] <= slice_bytes(SHAPE) <= 2 * working[0]  # measured 101 MiB against 112


def test_the_old_pool_is_untouched_and_the_new_one_holds_its_values():
    kv = filled("fp16", 64)
    before = snapshot(kv)
    new = converted(kv, "int8", 48, *STATS)  # a shrink too: ids >= 48 are dropped
    assert all(torch.equal(before[i][n], t) for i, layer in enumerate(kv.layers) for n, t in layer.items())
    back = converted(new, "fp16", 48)
    got, want = back.layers[1]["k"], kv.layers[1]["k"][:48]
    assert (got - want).abs().max() / want.abs().max() < 0.012  # measured 0.0058


def test_an_allocation_failure_mid_conversion_leaves_the_old_pool_whole():
    kv = filled("fp16", 64)
    before = snapshot(kv)
    made = []
    real = quant.layer_tensors

    def second_layer_fails(*args, **kwargs):
        made.append(1)
        if len(made) == 2:
            raise torch.OutOfMemoryError("injected")
        return real(*args, **kwargs)

    with mock.patch.object(quant, "layer_tensors", second_layer_fails), pytest.raises(torch.OutOfMemoryError):
        converted(kv, "int4", 64, *STATS)
    assert all(layer is not None for layer in kv.layers)
    assert all(torch.equal(before[i][n], t) for i, layer in enumerate(kv.layers) for n, t in layer.items())


def test_a_conversion_that_releases_frees_each_old_layer_once_converted():
    """For when the two pools cannot fit side by side: same result, the old pool given up."""
    kv, twin = filled("fp16", 64), filled("fp16", 64)
    new = converted(kv, "int8", 64, *STATS, release=True)
    want = converted(twin, "int8", 64, *STATS)
    assert kv.layers == [None, None]
    assert all(torch.equal(new.layers[i][n], want.layers[i][n]) for i in range(2) for n in want.layers[i])


def test_fp8_stores_values_over_their_head_scale_and_gives_them_back():
    """fp8 codes carry no per-token scale: each KV head's values are divided by its calibrated scale
    before rounding (0.05 here, so values of a few units land near 50, well inside e4m3's 448) and
    multiplied back when read. A round trip through fp8 is within e4m3's rounding."""
    kv = filled("fp16", 8)
    fp8 = converted(kv, "fp8", 8, *STATS)
    codes = quant.from_fp8(fp8.layers[0]["v"])
    rotated = quant.rotate(kv.layers[0]["v"], quant.hadamard(128)) / 0.05
    assert (codes - rotated).abs().max() <= rotated.abs().max() / 16  # half a step of e4m3 at the top
    back = converted(fp8, "fp16", 8)
    for name in ("k", "v"):
        want = kv.layers[1][name]
        err = (back.layers[1][name] - want).norm() / want.norm()
        assert err < 0.05, (name, err)  # measured: 0.026 (K and V)


def test_sinks_carry_over_between_pools_of_one_transform_only():
    """int8 and k8v4 transform keys alike, so their cached sink rows serve one another; int4's keys
    are only rotated (their statistics are per block) and fp8's rows are scaled otherwise."""
    kv = filled("int8", 8)
    kv.sink_cache[(1, 2, 3, 4)] = (torch.zeros(2, 4, 8, 128), torch.zeros(2, 4, 8, 128))
    assert list(converted(kv, "k8v4", 8, *STATS).sink_cache) == [(1, 2, 3, 4)]
    assert not converted(kv, "int4", 8, *STATS).sink_cache
    assert not converted(kv, "fp8", 8, *STATS).sink_cache
    fp8 = filled("fp8", 8)
    fp8.sink_cache[(5, 6, 7, 8)] = (torch.zeros(2, 4, 8, 128), torch.zeros(2, 4, 8, 128))
    assert list(converted(fp8, "fp8", 16, *STATS).sink_cache) == [(5, 6, 7, 8)]
    assert not converted(fp8, "int8", 8, *STATS).sink_cache
