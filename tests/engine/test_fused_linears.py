"""q/k/v and gate/up as one int8 kernel call each: the same logits, bit for bit, eagerly and in one
compiled graph."""
import pytest
import torch

from kvchat.engine.model import fused_linears, weights
from kvchat.engine.model.fused_linears import GroupPart
from kvchat.kernels import int8_rows


@pytest.fixture(scope="module")
def kernel():
    from kvchat.engine.compile_env import cpu_compile_missing, use_disk_cache

    if not int8_rows.cpu_supported():
        pytest.skip("this CPU runs none of the int8 kernel's variants: nothing is fused")
    assert cpu_compile_missing() is None
    use_disk_cache()
    assert int8_rows.build()


def quantized(arch, fuse: bool, monkeypatch):
    from tiny_models import tiny_model

    if not fuse:
        monkeypatch.setattr(weights, "fuse_groups", lambda *a: 0)
    model = weights.quantize_linears(tiny_model(arch), "int8")
    monkeypatch.undo()
    return model


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])  # plain, q/k/v bias, q/k norms
def test_fused_groups_give_the_unfused_logits_bit_for_bit(kernel, arch, monkeypatch):
    fused, plain = quantized(arch, True, monkeypatch), quantized(arch, False, monkeypatch)
    layers = fused.config.num_hidden_layers
    assert sum(isinstance(m, GroupPart) for m in fused.modules()) == 5 * layers
    assert not any(isinstance(m, GroupPart) for m in plain.modules())
    ids = torch.randint(3, 500, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want = plain(ids).logits
        assert torch.equal(fused(ids).logits, want)
        graphs = []
        got = torch.compile(fused, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)(ids).logits
    assert torch.equal(got, want)
    calls = [n for n in graphs[0].graph.nodes if n.target is torch.ops.kvchat.int8_rows]
    assert len(calls) == 4 * layers + 1  # q/k/v, o, gate/up, down a layer, and the head


def test_a_part_called_with_other_rows_computes_them(kernel):
    """Not the rows its siblings' product was for: the group's product again, for its rows."""
    g = torch.Generator().manual_seed(2)
    holder = torch.nn.Module()
    for name, n in (("q_proj", 64), ("k_proj", 32), ("v_proj", 32)):
        setattr(holder, name, torch.nn.Linear(96, n, bias=name != "k_proj"))
        getattr(holder, name).weight.data = torch.randn(n, 96, generator=g)
    alone = {name: weights.Int8Linear(getattr(holder, name), packed=True) for name in ("q_proj", "k_proj", "v_proj")}
    assert fused_linears.fuse(holder, ("q_proj", "k_proj", "v_proj"), int8_rows.fits, weights.Int8Linear)
    x, y = torch.randn(3, 96, generator=g), torch.randn(3, 96, generator=g)
    assert torch.equal(holder.q_proj(x), alone["q_proj"](x))
    assert torch.equal(holder.k_proj(y), alone["k_proj"](y))  # other rows: not x's columns
    assert torch.equal(holder.v_proj(x), alone["v_proj"](x))
    holder.q_proj(x)  # the group's product for x; then a sibling called with other rows (another thread's)
    assert holder.k_proj.pending.state[0] is x
    assert torch.equal(holder.v_proj(y), alone["v_proj"](y))
    assert torch.equal(holder.k_proj.weight_as(torch.float32), alone["k_proj"].weight_as(torch.float32))


def test_linears_of_other_input_sizes_or_odd_outputs_stay_apart():
    holder = torch.nn.Module()
    holder.gate_proj, holder.up_proj = torch.nn.Linear(64, 48), torch.nn.Linear(96, 48)
    assert not fused_linears.fuse(holder, ("gate_proj", "up_proj"), int8_rows.fits, weights.Int8Linear)
    holder.up_proj = torch.nn.Linear(64, 40)  # not a multiple of the kernel's 16 outputs
    assert not fused_linears.fuse(holder, ("gate_proj", "up_proj"), int8_rows.fits, weights.Int8Linear)
    assert type(holder.gate_proj) is torch.nn.Linear
