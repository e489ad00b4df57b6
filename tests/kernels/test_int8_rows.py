"""The CPU int8 kernel (``kernels/int8_rows.cpp``) against its torch twin and the plain product."""
import pytest
import torch

from kvchat.engine.model import weights
from kvchat.kernels import int8_rows


def codes_and_scales(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    return codes, scales


def dequantized(codes, scales):
    n, k = codes.shape
    return (codes.float().view(n, -1, 32) * scales.float()[..., None]).view(n, k)


@pytest.fixture(scope="module")
def kernel():
    from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

    if not int8_rows.cpu_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: the kernel is never used here")
    assert cpu_compile_missing() is None  # kvchat's toolchain travels with it: a compiler is always here
    use_disk_cache()
    assert int8_rows.build()
    return torch.ops.kvchat.int8_rows


def test_pack_and_unpack_are_inverse():
    codes, scales = codes_and_scales(48, 96)
    packed, packed_scales = int8_rows.pack(codes, scales)
    assert packed.shape == (3, 48, 16, 2) and packed_scales.shape == (3, 3, 16)
    assert packed[1, 5, 3, 1] == codes[16 + 3, 2 * 5 + 1]  # tile 1, k-pair 5, output 3, second k
    back, back_scales = int8_rows.unpack(packed, packed_scales)
    assert torch.equal(back, codes) and torch.equal(back_scales, scales)


def test_twin_rounds_each_group_of_a_row_to_int16_and_stays_within_that_of_the_product():
    codes, scales = codes_and_scales(32, 128, seed=1)
    x = torch.randn(3, 128)
    x[0, :32] = 0  # an all-zero group: scale 0, codes 0
    q, qs = int8_rows.quantize_rows(x)
    assert q.abs().max() == 32767 and qs[0, 0] == 0
    error = (q.view(3, 4, 32) * qs[..., None] - x.view(3, 4, 32)).abs()
    assert (error <= qs[..., None] * 0.5001).all()  # half a step of the group's scale
    got = int8_rows.twin(x, *int8_rows.pack(codes, scales))
    want = x @ dequantized(codes, scales).T
    # each product's error is at most half a step of its group's int16 code
    weight_sums = dequantized(codes, scales).abs().view(32, 4, 32).sum(-1)  # [n, group]
    bound = (qs[:, None, :] / 2 * weight_sums[None]).sum(-1)
    assert ((got - want).abs() <= bound + 1e-6).all()
    assert (got - want).abs().max() > 0  # the rounding is real: a twin of the plain product would be 0


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 16, 70])
def test_kernel_equals_its_twin(kernel, rows):
    codes, scales = codes_and_scales(48, 160, seed=rows)
    packed = int8_rows.pack(codes, scales)
    x = torch.randn(rows, 160) * 3
    torch.testing.assert_close(kernel(x, *packed), int8_rows.twin(x, *packed), atol=1e-5, rtol=1e-5)


def test_each_row_equals_itself_computed_alone_bit_for_bit(kernel):
    """What makes a batched step's replies those of one sequence at a time: a row's sums do not
    depend on the rows beside it (8 per register block, 11 = a block and a part)."""
    codes, scales = codes_and_scales(64, 96, seed=3)
    packed = int8_rows.pack(codes, scales)
    x = torch.randn(11, 96)
    together = kernel(x, *packed)
    assert torch.equal(together, torch.cat([kernel(x[i:i + 1], *packed) for i in range(11)]))


def test_int8_layer_runs_the_kernel_in_a_compiled_graph_and_eagerly(kernel):
    layer = torch.nn.Linear(96, 64, bias=True)
    q = weights.Int8Linear(layer, packed=True)
    assert q.packed and q.qweight.shape == (4, 48, 16, 2)
    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(5, 1, 96)
    eager = q(x)
    torch.compile(q, backend=keep_graph, fullgraph=True)(x)
    assert torch.ops.kvchat.int8_rows in [node.target for node in graphs[0].graph.nodes]
    assert torch.equal(torch.compile(q, fullgraph=True)(x), eager)
    codes, scales = q.codes()
    torch.testing.assert_close(eager, int8_rows.twin(x.view(5, 96), *q._buffers.values()).view(5, 1, 64) + layer.bias,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, x @ q.weight_as(torch.float32).T + layer.bias, atol=1e-3, rtol=1e-3)


def test_shapes_the_kernel_does_not_take_keep_the_row_major_layout():
    assert not int8_rows.fits(23, 96) and not int8_rows.fits(32, 48)
    q = weights.Int8Linear(torch.nn.Linear(96, 23))
    assert not q.packed and q.qweight.shape == (23, 96)
