"""Auto weights on the CPU, chosen by timing each mode's products for the model's shapes."""
import json
import math

import pytest
from kvchat.engine.model import weight_speed
from kvchat.kernels import int8_rows


def test_token_shapes_are_the_models_own_linears():
    from tiny_models import tiny_model

    for arch in ("llama", "qwen2", "qwen3"):
        model = tiny_model(arch)
        layer, layers, head = weight_speed.token_shapes(model.config)
        first = model.model.layers[0]
        want = [tuple(m.weight.shape) for m in (first.self_attn.q_proj, first.self_attn.k_proj, first.self_attn.v_proj,
                                                first.self_attn.o_proj, first.mlp.gate_proj, first.mlp.up_proj,
                                                first.mlp.down_proj)]
        assert layer == want and layers == len(model.model.layers)
        assert head == tuple(model.get_output_embeddings().weight.shape)


@pytest.fixture
def timed(monkeypatch, tmp_path):
    """choose() with the times given, counting the measurements; its store in a temp dir."""
    monkeypatch.setattr(weight_speed, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(weight_speed, "candidates", lambda compiled, four_bit=False: (
        ["none", "int8"] + (["int4"] if four_bit else []) if compiled else ["none"]))
    monkeypatch.setattr(int8_rows, "built", True)
    import kvchat.engine.model.kernel_build as kernel_build

    monkeypatch.setattr(kernel_build, "build_kernel", lambda: None)
    monkeypatch.setattr(kernel_build, "kernel_built_before", lambda: True)
    calls, figures = [], {}

    def time_token(mode, config):
        calls.append(mode)
        return figures[mode]

    monkeypatch.setattr(weight_speed, "time_token", time_token)
    return calls, figures, tmp_path


def config():
    from tiny_models import tiny_model

    return tiny_model("llama").config


def test_auto_keeps_the_fastest_mode_and_says_why_once_measured(timed):
    calls, figures, folder = timed
    figures.update(none=0.020, int8=0.008)
    mode, why = weight_speed.choose(config(), compiled=True)
    assert mode == "int8" and why == "int8: fastest here (products tok/s: int8 125, fp32 50)"
    assert sorted(calls) == ["int8", "none"]
    assert weight_speed.choose(config(), compiled=True)[0] == "int8" and len(calls) == 2  # read, not timed again
    stored = json.loads((folder / "weight_speed.json").read_text())
    assert list(stored.values()) == [{"none": 0.020, "int8": 0.008}]


def test_a_checkpoint_stored_in_four_bits_may_get_int4_when_it_is_fastest(timed):
    calls, figures, _ = timed
    figures.update(none=0.020, int8=0.008, int4=0.006)
    assert weight_speed.choose(config(), compiled=True)[0] == "int8"  # not 4-bit: int4 is not offered
    mode, why = weight_speed.choose(config(), compiled=True, four_bit=True)
    assert mode == "int4" and why.startswith("int4: fastest here (products tok/s: int4 167, int8 125, fp32 50")


def test_int4_within_the_margin_of_int8_is_taken_for_its_fewer_bytes(timed):
    """What the AVX-VNNI proxy timed (10.2 against 10.5 ms), where int4 then decoded 5-10 % faster."""
    calls, figures, _ = timed
    figures.update(none=0.0218, int8=0.0102, int4=0.0105)
    mode, why = weight_speed.choose(config(), compiled=True, four_bit=True)
    assert mode == "int4" and why == "int4: as fast as int8 in fewer bytes (products tok/s: int8 98, int4 95, fp32 46)"
    figures.update(int4=0.0108)  # 5.9 % slower: int8 keeps it
    calls.clear()
    weight_speed._store().unlink()
    assert weight_speed.choose(config(), compiled=True, four_bit=True)[0] == "int8"
    figures.update(none=0.0106, int8=0.0100, int4=0.0104)  # int4 within 5 % of int8, but not 5 % ahead of fp32
    weight_speed._store().unlink()
    assert weight_speed.choose(config(), compiled=True, four_bit=True)[0] == "int8"


def test_the_starter_is_stored_in_four_bits_and_a_float_gguf_is_not(tmp_path):
    from tiny_models import write_tiny_gguf

    from kvchat.core.model_source import resolve
    from kvchat.engine.model.loading import _stored_in_four_bits

    assert _stored_in_four_bits(resolve("starter"))  # Q4_1
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    assert not _stored_in_four_bits(resolve(str(path)))


def test_auto_never_picks_a_mode_slower_than_the_checkpoints_own(timed):
    """What the AVX2 machine saw: int8 at half the speed of fp32 (inductor's loops by g++)."""
    calls, figures, _ = timed
    figures.update(none=0.044, int8=0.085)
    assert weight_speed.choose(config(), compiled=True)[0] == "none"


def test_a_gain_within_the_measurements_noise_keeps_the_checkpoints_weights(timed):
    calls, figures, _ = timed
    figures.update(none=0.0200, int8=0.0195)  # 2.5 % faster: under the 5 % margin
    assert weight_speed.choose(config(), compiled=True)[0] == "none"


def test_without_compiling_nothing_is_timed(timed):
    calls, _, _ = timed
    assert weight_speed.choose(config(), compiled=False) == ("none", "no faster mode runs here")
    assert calls == []


def test_another_isa_is_measured_again(timed, monkeypatch):
    calls, figures, _ = timed
    figures.update(none=0.02, int8=0.01)
    monkeypatch.setattr(weight_speed.cpu_isa, "chosen", lambda: "avx512_vnni")
    weight_speed.choose(config(), compiled=True)
    monkeypatch.setattr(weight_speed.cpu_isa, "chosen", lambda: "avx2")
    weight_speed.choose(config(), compiled=True)
    assert len(calls) == 4


def test_time_token_runs_each_modes_products():
    """Real products of a tiny model's shapes (figures not asserted: they are this machine's)."""
    from kvchat.engine.compile_env import cpu_compile_missing
    from kvchat.engine.model.kernel_build import build_kernel

    modes = ["none"]
    if int8_rows.cpu_supported() and cpu_compile_missing() is None:
        build_kernel()
        modes.append("int8")
    for mode in modes:
        seconds = weight_speed.time_token(mode, config(), rounds=1)
        assert seconds > 0 and math.isfinite(seconds), (mode, seconds)
    assert weight_speed.candidates(compiled=False) == ["none"]


def test_a_model_whose_head_the_kernel_cannot_take_keeps_its_own_weights(timed):
    """A vocabulary of 32,001 (not a multiple of the kernel's 16 outputs): no mode is timed."""
    calls, figures, _ = timed
    odd = config()
    odd.vocab_size = 32001
    assert not weight_speed.fit_the_kernel(odd) and weight_speed.fit_the_kernel(config())
    assert weight_speed.choose(odd, compiled=True)[0] == "none" and calls == []


def test_a_first_start_before_the_kernel_was_ever_built_takes_the_rule_and_times_nothing(timed, monkeypatch):
    """A reply must not wait for the kernel's first build (a minute with the bundled clang)."""
    import kvchat.engine.model.kernel_build as kernel_build

    calls, figures, _ = timed
    monkeypatch.setattr(kernel_build, "kernel_built_before", lambda: False)
    mode, why = weight_speed.choose(config(), compiled=True, four_bit=True)
    assert mode == "int8" and "next start" in why and calls == []
