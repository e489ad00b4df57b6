"""CPU weight-only quantization against hand-computed twins."""
import copy

import pytest
import torch
from torch import nn

from kvchat.engine.model import weights
from kvchat.kernels import int8_rows
from kvchat.engine.model.weights import INT4_GROUP, INT8_GROUP, Int4Linear, Int8Linear, _codes, quantize_linears, weight_bytes

from tiny_models import tiny_model


def linear(n=96, k=128, bias=False, seed=0):
    torch.manual_seed(seed)
    layer = nn.Linear(k, n, bias=bias)
    nn.init.normal_(layer.weight, std=0.05)
    return layer


def test_int8_stores_each_weight_within_half_a_step_of_its_group_scale():
    layer = linear()
    q = Int8Linear(layer, packed=False)  # the rounding, whatever the layout
    w = layer.weight.detach().view(96, -1, INT8_GROUP)
    scales = q.scales
    step = scales.float()[..., None]
    assert torch.equal(scales.float(), (w.abs().amax(-1) / 127).to(torch.bfloat16).float())
    assert ((q.weight_as(torch.float32).view_as(w) - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_int8_forward_is_the_product_with_its_dequantized_weight(monkeypatch, rows, packed):
    """Row-major, and packed for the kernel before it is built (or where it cannot be): inductor's
    product over the unpacked codes. The kernel's own: tests/kernels/test_int8_rows.py."""
    monkeypatch.setattr(int8_rows, "built", False)
    layer = linear(bias=True)
    q = Int8Linear(layer, packed=packed)
    x = torch.randn(1, rows, 128)
    want = x @ q.weight_as(torch.float32).T + layer.bias
    torch.testing.assert_close(q(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_int8_eager_product_in_slices_covers_every_output_once(monkeypatch, rows):
    """Before its twin is compiled a layer runs in slices of the weight's output rows: slices of
    5 rows of 96 (480 floats), the last one short, give the whole product in order."""
    monkeypatch.setattr(weights, "_ready_twins", {})
    monkeypatch.setattr(weights, "SLICE_FLOATS", 480)
    q = Int8Linear(linear(n=23, k=96, seed=4))  # 23 outputs: never packed
    calls = []
    monkeypatch.setattr(weights, "_dequantized", lambda qw, sc, dtype: calls.append(qw.shape[0]) or
                        (qw.view(qw.shape[0], -1, 32).to(dtype) * sc.to(dtype)[..., None]).view(qw.shape))
    x = torch.randn(rows, 96)
    torch.testing.assert_close(q(x), x @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)
    assert calls == [5, 5, 5, 5, 3, 23]  # the slices, then weight_as for the reference


def test_int8_compiled_single_row_equals_eager():
    q = Int8Linear(linear(n=64, k=96, seed=1), packed=False)
    x = torch.randn(1, 1, 96)
    compiled = torch.compile(q, fullgraph=True)
    torch.testing.assert_close(compiled(x), q(x), atol=1e-5, rtol=1e-5)


def test_int8_compiled_batch_of_normed_rows_reads_them_written_out_and_equals_the_dequantized_product():
    """A batched decode step's rows come out of an RMS norm. Compiled, the products read them
    through ``kvchat::rows_as_they_are`` (fused, the norm made some products run row by row), in
    one graph, and give the product with the dequantized weight."""
    q = Int8Linear(linear(n=64, k=96, seed=2), packed=False)
    gain = torch.rand(96) + 0.5

    def normed(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    def normed_product(x):
        return q(normed(x))

    graphs = []

    def keep_graph(gm, inputs):
        graphs.append(gm)
        return gm.forward

    x = torch.randn(5, 1, 96)
    torch.compile(normed_product, backend=keep_graph, fullgraph=True)(x)
    targets = [node.target for node in graphs[0].graph.nodes]
    assert targets.count(torch.ops.kvchat.rows_as_they_are.default) == 1
    want = normed(x) @ q.weight_as(torch.float32).T
    torch.testing.assert_close(torch.compile(normed_product, fullgraph=True)(x), want, atol=1e-5, rtol=1e-5)


def test_int8_eager_paths_run_compiled_after_the_warm_up_for_every_shape_and_equal_the_dequantized_product(monkeypatch):
    monkeypatch.setattr(weights, "_ready_twins", {})
    layers = [Int8Linear(linear(n=n, k=k, seed=n), packed=False) for n, k in ((96, 128), (64, 64), (160, 96))]  # n == k: dynamic shapes specialise it
    weights.warm_up(nn.Sequential(*layers, nn.LayerNorm(8)))  # the norm: a parameter to take the dtype from
    assert {fn: twin.compiled is not None for fn, twin in weights._ready_twins.items()} == {
        weights._rows_product: True, weights._row_product: True}
    for q in layers:
        for rows in (1, 3):
            x = torch.randn(rows, q.in_features)
            torch.testing.assert_close(q(x), x @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)


def test_int8_compiles_only_in_the_warm_up_and_falls_back_to_eager_once_when_that_fails(monkeypatch, caplog):
    """The engine thread never waits for the int8 twins' compile: before the warm-up (on the
    decode step's compile thread) the layer runs plain torch; a failed compile is said once per
    twin, and the layer goes on eagerly."""
    tried = []

    def broken(*args):
        tried.append(args[0].shape)
        raise RuntimeError("no compiler today")

    weights.fused.cache_clear()  # compiled twins made by other tests
    monkeypatch.setattr(weights, "_ready_twins", {})
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: broken)
    q = Int8Linear(linear(seed=3), packed=False)
    x = torch.randn(4, 128)
    try:
        torch.testing.assert_close(q(x), x @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)
        assert tried == [] and weights.fused.cache_info().currsize == 0  # not even made: that imports inductor
        weights.warm_up(nn.Sequential(q, nn.LayerNorm(128)))  # the norm: a parameter to take the dtype from
        for _ in range(2):
            torch.testing.assert_close(q(x), x @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(q(x[:1]), x[:1] @ q.weight_as(torch.float32).T, atol=1e-5, rtol=1e-5)
    finally:
        weights.fused.cache_clear()  # later tests compile again, with the real compiler
    assert len(tried) == 2  # the chunk's twin and the row's, once each
    assert [r.getMessage() for r in caplog.records] == ["int8 weights without compilation (RuntimeError: no compiler today)"] * 2


def test_int4_holds_q4_1_values_up_to_its_bf16_scale_and_zero():
    """GGUF's Q4_1: w = q * d + m per group of 32. Built from such values with d and m exact in
    bf16, the kernel's (q - 8) * d + (m + 8 d) gives them back up to bf16 rounding of the zero."""
    g = torch.Generator().manual_seed(2)
    n, k = 64, 128
    d = torch.rand(n, k // INT4_GROUP, generator=g).add(0.5).mul(0.01).to(torch.bfloat16).float()
    m = -8 * d
    codes = torch.randint(0, 16, (n, k // INT4_GROUP, INT4_GROUP), generator=g)
    codes[..., 0], codes[..., 1] = 0, 15  # each group spans its whole range, as Q4_1 makes it
    layer = nn.Linear(k, n, bias=False)
    layer.weight.data = (codes * d[..., None] + m[..., None]).view(n, k)
    x = torch.randn(3, k, generator=g)
    want = x.to(torch.bfloat16).float() @ layer.weight.detach().T
    torch.testing.assert_close(Int4Linear(layer)(x), want, atol=2e-2, rtol=2e-2)


def test_int4_finds_the_codes_of_q4_1_groups_that_do_not_span_all_16():
    """A Q4_1 block whose codes span j < 15 steps: min-max rounding to 15 steps moves its values,
    the grid search finds a grid that holds them all (d and m as GGUF stores them, in fp16)."""
    g = torch.Generator().manual_seed(3)
    n, k = 32, 64
    d = torch.rand(n, k // INT4_GROUP, 1, generator=g).add(0.5).mul(0.01).half().float()
    m = torch.randn(n, k // INT4_GROUP, 1, generator=g).mul(0.05).half().float()
    span = torch.randint(1, 16, (n, k // INT4_GROUP, 1), generator=g)  # the codes' range: 0..span
    codes = (torch.rand(n, k // INT4_GROUP, INT4_GROUP, generator=g) * (span + 1)).floor().clamp(max=span)
    codes[..., :1], codes[..., 1:2] = 0, span  # each group reaches both ends of its range
    groups = codes * d + m
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)

    def worst(q):  # the largest error, in steps, of the least-squares fit of each group on q
        centred = q - q.mean(-1, keepdim=True)
        scale = (centred * groups).sum(-1, keepdim=True) / centred.square().sum(-1, keepdim=True)
        zero = (groups - q * scale).mean(-1, keepdim=True)
        return ((q * scale + zero - groups).abs() / d).max().item()

    found = _codes(groups)
    assert found.min() >= 0 and found.max() <= 15
    assert worst(found) < 1e-3
    assert worst(torch.round((groups - low) / (high - low) * 15)) > 0.1  # what min-max rounding did


def test_int4_keeps_the_head_at_int8():
    model = tiny_model("llama")
    quantize_linears(model, "int4")
    assert isinstance(model.lm_head, Int8Linear)
    mlp = model.model.layers[0].mlp
    assert isinstance(mlp.down_proj, Int4Linear)
    up = mlp.up_proj  # with gate_proj, one 4-bit product where kvchat's kernel runs (fused_linears)
    assert isinstance(getattr(up, "fused", up), Int4Linear)


def test_quantize_linears_replaces_every_linear_and_unties_the_head():
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True  # as the starter's
    model.lm_head.weight = model.model.embed_tokens.weight
    ref = copy.deepcopy(model)
    quantize_linears(model, "int8")
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.lm_head, Int8Linear) and not model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the lookup stays as it was
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want, got = ref(ids).logits, model(ids).logits
    assert (got - want).abs().max() < 0.02 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_weight_bytes_counts_what_a_token_reads():
    model = tiny_model("llama")  # untied: the embedding is read one row a step
    hidden, vocab = 256, 512
    total = sum(p.numel() * 4 for p in model.parameters())
    assert weight_bytes(model) == total - (vocab - 1) * hidden * 4
    quantize_linears(model, "int8")
    linears = sum(m.qweight.numel() * 1 + m.scales.numel() * 2 for m in model.modules() if isinstance(m, Int8Linear))
    norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
    assert weight_bytes(model) == linears + norms + hidden * 4
