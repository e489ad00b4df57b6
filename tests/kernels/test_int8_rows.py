"""The CPU int8 kernel (``kernels/int8_rows.cpp``) against its torch twin and the plain product."""
import pytest
import torch

from kvchat.engine.model import weights
from kvchat.kernels import cpu_isa, int8_rows

# every variant this CPU executes: an AVX-512 machine runs all three, so what AVX2 and AVX-VNNI
# desktops get is tested here too
ISAS = cpu_isa.available()


def codes_and_scales(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    return codes, scales


def dequantized(codes, scales):
    n, k = codes.shape
    return (codes.float().view(n, -1, 32) * scales.float()[..., None]).view(n, k)


@pytest.fixture(scope="module")
def built():
    from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

    if not ISAS:
        pytest.skip("this CPU runs none of the kernel's variants (x86-64 with AVX2 and up)")
    assert cpu_compile_missing() is None  # kvchat's toolchain travels with it: a compiler is always here
    use_disk_cache()
    assert int8_rows.build()
    return int8_rows.isa


@pytest.fixture(params=ISAS or ["none"])
def kernel(built, request):
    """The op, running each variant in turn; the build's own choice again afterwards."""
    int8_rows.use(request.param)
    yield torch.ops.kvchat.int8_rows
    int8_rows.use(built)


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
    assert (error <= qs[..., None] * 0.51).all()  # half a step of the group's scale, and float rounding
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


def test_every_variant_gives_the_same_bits(built):
    """AVX2, AVX-VNNI and AVX-512 VNNI: exact integer sums, the same float steps per lane."""
    codes, scales = codes_and_scales(80, 352, seed=7)
    packed = int8_rows.pack(codes, scales)
    x = torch.randn(13, 352) * 5
    x[2, 32:64] = 0  # a group of zeros: scale 0
    x[4, :32] *= 1e4  # a group whose top code saturates nothing
    outs = {}
    try:
        for isa in ISAS:
            int8_rows.use(isa)
            outs[isa] = torch.ops.kvchat.int8_rows(x, *packed)
    finally:
        int8_rows.use(built)
    assert len(outs) == len(ISAS) >= 1
    first = outs[ISAS[0]]
    torch.testing.assert_close(first, int8_rows.twin(x, *packed), atol=1e-3, rtol=1e-5)
    for isa in ISAS[1:]:
        assert torch.equal(outs[isa], first), isa


def test_the_override_picks_the_variant_and_refuses_what_the_cpu_cannot_run(monkeypatch):
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv(cpu_isa.OVERRIDE, raising=False)
    assert cpu_isa.chosen() == (ISAS[-1] if ISAS else None)
    for isa in ISAS:
        monkeypatch.setenv(cpu_isa.OVERRIDE, isa)
        assert cpu_isa.chosen() == isa and cpu_isa.override_problem() is None
    monkeypatch.setenv(cpu_isa.OVERRIDE, "sse9")
    assert cpu_isa.chosen() is None and "not one of avx2, avx_vnni, avx512_vnni" in cpu_isa.override_problem()
    monkeypatch.delenv(cpu_isa.OVERRIDE)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")  # torch's cap alone: no 512-bit kernel either
    assert cpu_isa.chosen() == ([i for i in ISAS if i != "avx512_vnni"] or [None])[-1]
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cpu_isa.chosen() is None
    missing = [isa for isa in cpu_isa.ISAS if not cpu_isa.runs(isa)]
    if missing:  # a CPU without AVX-512: the override cannot pretend it has it
        monkeypatch.setenv(cpu_isa.OVERRIDE, missing[-1])
        assert cpu_isa.chosen() is None and "cannot run" in cpu_isa.override_problem()


@pytest.mark.slow
def test_int8_layer_runs_the_kernel_in_a_compiled_graph_and_eagerly(built):
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
    torch.testing.assert_close(eager, int8_rows.twin(x.view(5, 96), *q._buffers.values()).view(5, 1, 64) + layer.bias,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(eager, x @ q.weight_as(torch.float32).T + layer.bias, atol=1e-3, rtol=1e-3)


def test_shapes_the_kernel_does_not_take_keep_the_row_major_layout():
    assert not int8_rows.fits(23, 96) and not int8_rows.fits(32, 48)
    q = weights.Int8Linear(torch.nn.Linear(96, 23))
    assert not q.packed and q.qweight.shape == (23, 96)


def test_the_op_takes_bf16_and_strided_rows_and_refuses_a_layout_it_would_misread(kernel):
    codes, scales = codes_and_scales(32, 64, seed=5)
    packed = int8_rows.pack(codes, scales)
    x = torch.randn(64, 3).T  # strided
    torch.testing.assert_close(kernel(x, *packed), int8_rows.twin(x.contiguous(), *packed), atol=1e-5, rtol=1e-5)
    half = x.to(torch.bfloat16)
    torch.testing.assert_close(kernel(half, *packed), int8_rows.twin(half.float(), *packed), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="not the layout of pack"):
        kernel(torch.randn(2, 96), *packed)  # k of another matrix: the kernel would read past the codes
    with pytest.raises(ValueError, match="not the layout of pack"):
        kernel(x, packed[0], packed[1].float())  # scales made fp32 (a module's .float())


@pytest.mark.parametrize("rows", [1, 3])
def test_packed_weights_before_the_kernel_is_built_run_inductors_product_in_slices_of_tiles(monkeypatch, rows):
    """Until the kernel is built (or where it fails to), a packed layer runs the old products,
    unpacking one slice of 16-output tiles at a time, not the whole weight."""
    monkeypatch.setattr(int8_rows, "built", False)
    monkeypatch.setattr(weights, "_ready_twins", {})
    monkeypatch.setattr(weights, "SLICE_FLOATS", 96 * 16 * 2)  # two tiles of 16 outputs
    q = weights.Int8Linear(torch.nn.Linear(96, 96, bias=False), packed=True)
    sliced = []
    unpack = int8_rows.unpack
    monkeypatch.setattr(int8_rows, "unpack", lambda p, s: sliced.append(p.shape[0]) or unpack(p, s))
    x = torch.randn(rows, 96)
    got = q(x)
    assert sliced == [2, 2, 2]
    torch.testing.assert_close(got, x @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)


def test_packed_weights_without_the_kernel_compile_to_inductors_batch_product(monkeypatch):
    """Where the kernel is not built, a compiled step's product is inductor's, reading the packed
    codes in its graph (the unpacking traced with it), and never the op."""
    monkeypatch.setattr(int8_rows, "built", False)
    q = weights.Int8Linear(torch.nn.Linear(96, 64, bias=False), packed=True)
    x = torch.randn(5, 96)
    graphs = []
    torch.compile(q, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(x)
    targets = [node.target for node in graphs[0].graph.nodes]
    assert torch.ops.kvchat.rows_as_they_are.default in targets and torch.ops.kvchat.int8_rows not in targets
    placeholders = [node for node in graphs[0].graph.nodes if node.op == "placeholder"]
    assert [p.meta["example_value"].dim() for p in placeholders].count(4) == 1  # the packed codes, read as they are
    torch.testing.assert_close(torch.compile(q, fullgraph=True)(x), x @ q.weight_as(torch.float32).T,
                               atol=1e-5, rtol=1e-5)


def test_an_int8_load_builds_the_kernel_on_its_own_thread(built, monkeypatch):
    """From the load on, not only from the compile thread's warm-up (which a compile child holds
    back for minutes on a first start): eager steps get the kernel within seconds."""
    import threading

    from tiny_models import tiny_model

    for name, value in (("built", False), ("_lib", None), ("failed", False)):
        monkeypatch.setattr(int8_rows, name, value)
    monkeypatch.setattr(weights, "_ready_twins", {})  # the warm-up below fills it
    model = weights.quantize_linears(tiny_model("llama"), "int8")
    assert all(m.packed for m in model.modules() if isinstance(m, weights.Int8Linear))
    for builder in [t for t in threading.enumerate() if t.name == "kvchat-int8-kernel"]:
        builder.join(timeout=120)
    assert int8_rows.built  # by the load's thread: no warm-up has run
    weights.warm_up(model)  # finds it built
    ids = torch.randint(3, 500, (1, 6), generator=torch.Generator().manual_seed(0))
    graphs = []
    with torch.inference_mode():
        torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm.forward)(ids)
    ops = [n for n in graphs[0].graph.nodes if n.target is torch.ops.kvchat.int8_rows]
    assert len(ops) == 4 * model.config.num_hidden_layers + 1  # q/k/v, o, gate/up, down (fused_linears), the head


def four_bit(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-4).to(torch.bfloat16)
    zeros = (torch.randn(n, k // 32, generator=g) * 0.01).to(torch.bfloat16)
    return codes, scales, zeros


def test_pack4_and_unpack4_are_inverse_and_put_two_codes_a_byte():
    codes, scales, zeros = four_bit(48, 96)
    packed, s, z = int8_rows.pack4(codes, scales, zeros)
    assert packed.shape == (3, 24, 16, 2) and packed.dtype == torch.uint8 and s.shape == z.shape == (3, 3, 16)
    # tile 1, chunk 5 (k 20..23), output 3, t = 1: k 21 low, k 23 high
    assert packed[1, 5, 3, 1] == codes[19, 21] | (codes[19, 23] << 4)
    back = int8_rows.unpack4(packed, s, z)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scales) and torch.equal(back[2], zeros)


@pytest.mark.parametrize("rows", [1, 3, 8, 11, 70])
def test_the_4_bit_kernel_equals_its_twin_and_the_dequantized_product(kernel, rows):
    codes, scales, zeros = four_bit(48, 160, seed=rows)
    packed = int8_rows.pack4(codes, scales, zeros)
    x = torch.randn(rows, 160) * 3
    got = torch.ops.kvchat.int4_rows(x, *packed)
    torch.testing.assert_close(got, int8_rows.twin4(x, *packed), atol=1e-5, rtol=1e-5)
    w = ((codes - 8).float().view(48, -1, 32) * scales.float()[..., None] + zeros.float()[..., None]).view(48, 160)
    torch.testing.assert_close(got, x @ w.T, atol=2e-3, rtol=1e-3)  # the rows' int16 rounding


def test_the_4_bit_kernel_gives_the_same_bits_on_every_variant_and_for_each_row_alone(built):
    codes, scales, zeros = four_bit(80, 352, seed=9)
    packed = int8_rows.pack4(codes, scales, zeros)
    x = torch.randn(13, 352) * 5
    outs = {}
    try:
        for isa in ISAS:
            int8_rows.use(isa)
            outs[isa] = torch.ops.kvchat.int4_rows(x, *packed)
            alone = torch.cat([torch.ops.kvchat.int4_rows(x[i:i + 1], *packed) for i in range(13)])
            assert torch.equal(alone, outs[isa]), isa
    finally:
        int8_rows.use(built)
    assert all(torch.equal(out, outs[ISAS[0]]) for out in outs.values())


PREBUILT_CHILD = """
import json, shutil, sys
from pathlib import Path
import torch
from kvchat.engine import compile_env
from kvchat.engine.model import kernel_build
from kvchat.kernels import cpu_attention, cpu_isa, int8_rows  # noqa: F401 - the attention op

folder = Path(sys.argv[1])
int8_rows._SOURCE = folder / "int8_rows.cpp"  # the copy the library beside it was built from
compile_env.cpu_compile_missing = lambda: "no compiler here"  # what the app's user may lack
x, packed, packed4, attention = torch.load(folder / "inputs.pt")
kernel_build.build_kernel()
outs = {"attention": torch.ops.kvchat.decode_attention(*attention)}
for isa in cpu_isa.available():
    int8_rows.use(isa)
    outs[isa] = (torch.ops.kvchat.int8_rows(x, *packed), torch.ops.kvchat.int4_rows(x, *packed4),
                 torch.cat([torch.ops.kvchat.int8_rows(x[i:i + 1], *packed) for i in range(len(x))]))
torch.save(outs, folder / "outputs.pt")
print(json.dumps({"origin": int8_rows.origin, "runs_here": kernel_build.kernel_runs_here()}))
"""


@pytest.mark.slow
def test_the_prebuilt_kernel_runs_without_a_compiler_and_gives_the_built_kernels_bits(built, tmp_path):
    """The packaged app's kernel (kernel_build.prebuild: the bundled clang, no -march) loads in a
    process where nothing can compile, and every variant gives what the kernel built here gives."""
    import json
    import shutil
    import subprocess
    import sys

    from kvchat.engine.model import kernel_build

    for source in int8_rows.sources():
        shutil.copy(source, tmp_path / source.name)
    original = int8_rows._SOURCE
    int8_rows._SOURCE = tmp_path / "int8_rows.cpp"
    try:
        library = kernel_build.prebuild(tmp_path)
    finally:
        int8_rows._SOURCE = original
    assert library.name == int8_rows.prebuilt_name()  # named after the source: same text, same name
    codes, scales = codes_and_scales(80, 352, seed=11)
    packed = int8_rows.pack(codes, scales)
    packed4 = int8_rows.pack4(*four_bit(80, 352, seed=12))
    x = torch.randn(13, 352) * 5
    pool = torch.randn(2, 30, 16, 2, 64)
    # over 64 positions: several chunks to merge, whose sums a fused multiply-add would round otherwise
    attention = (torch.randn(3, 4, 64), *pool, torch.randperm(30).view(3, 10), torch.tensor([150, 97, 7], dtype=torch.int32),
                 0.125, 0)
    torch.save((x, packed, packed4, attention), tmp_path / "inputs.pt")
    proc = subprocess.run([sys.executable, "-c", PREBUILT_CHILD, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"origin": "prebuilt", "runs_here": True}
    outs = torch.load(tmp_path / "outputs.pt")
    assert torch.equal(outs.pop("attention"), torch.ops.kvchat.decode_attention(*attention))
    assert set(outs) == set(ISAS)
    try:
        for isa, (rows8, rows4, alone) in outs.items():
            int8_rows.use(isa)
            assert torch.equal(rows8, torch.ops.kvchat.int8_rows(x, *packed)), isa
            assert torch.equal(rows4, torch.ops.kvchat.int4_rows(x, *packed4)), isa
            assert torch.equal(alone, rows8), isa
    finally:
        int8_rows.use(built)
