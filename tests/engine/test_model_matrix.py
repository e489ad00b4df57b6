"""The models with a sliding window or soft caps (Mistral v0.1, Qwen2 with a window, Gemma 2 and 3,
Phi-3) through the paged engine, against transformers' own forward and generate(). The plain
architectures are in test_parity."""
import copy
import json

import pytest
import torch

from kvchat.bench.decode import IdTokenizer
from kvchat.core.config import EngineConfig, Precision, SamplingParams
from kvchat.core.events import Request
from kvchat.engine.chat import ChatFormatter
from kvchat.engine.engine import Engine
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.model.runner import ModelRunner
from kvchat.core.memory_policy import MemoryPolicy, Preempt

from test_decode_step import decode
from test_parity import TOL, assert_decode_matches, paged_runner, prefill, prompt
from tiny_models import ARCHS, WINDOW, WINDOWED, as_loaded, tiny_model


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def model(request):
    return tiny_model(request.param)


def unwindowed(model):
    """``model`` with every window wider than any test's sequence."""
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 1 << 20
    for module in wide.modules():
        if getattr(module, "sliding_window", None):
            module.sliding_window = 1 << 20
    return wide


@torch.inference_mode()
def test_the_window_changes_what_the_model_says(model):
    """A guard for the tests below: past the window, the windowed model's own logits are not the
    plain causal ones, so an engine that ignored the window would fail them."""
    ids = torch.tensor([prompt(3 * WINDOW)])
    assert (model(ids).logits[0, -1] - unwindowed(model)(ids).logits[0, -1]).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
@torch.inference_mode()
def test_gemma_2s_soft_caps_change_what_the_model_says(cap):
    """The same guard for the soft caps: each changes the tiny Gemma 2's logits."""
    ids = torch.tensor([prompt(3 * WINDOW)])
    capped, plain = tiny_model("gemma2"), tiny_model("gemma2", **{cap: None})
    assert (capped(ids).logits[0, -1] - plain(ids).logits[0, -1]).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("chunk", [512, 37])
@torch.inference_mode()
def test_prefill_across_the_window_matches_transformers(model, chunk):
    ids = prompt(3 * WINDOW)
    runner, mgr = paged_runner(model)
    _, logits = prefill(runner, mgr, ids, chunk)
    assert (logits - model(torch.tensor([ids])).logits[0, -1]).abs().max().item() <= TOL


@torch.inference_mode()
def test_decode_steps_past_the_window_match_transformers(model):
    runner, mgr = paged_runner(model)
    seq, logits = prefill(runner, mgr, prompt(30), 11)
    assert_decode_matches(model, runner, mgr, seq, logits, steps=WINDOW + 64)


def test_greedy_tokens_64_past_the_window_match_generate(model, tokenizer):
    ids = prompt(20, seed=3)
    new = WINDOW + 64
    expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)[0, len(ids):]
    engine = Engine(EngineConfig(max_context=256, prefill_chunk=8), loaded=as_loaded(model, tokenizer))
    done = engine.submit(Request(prompt_ids=ids, sampling=SamplingParams(
        max_new_tokens=new, temperature=0, ignore_eos=True))).result()
    engine.close()
    assert done.token_ids == expected.tolist()


def decode_logits(lm, precision: str, ids: list[int], steps: int, mode: str = "eager") -> torch.Tensor:
    """The logits of each of ``steps`` teacher-forced decode steps after ``ids[:-steps]``."""
    pool = KVPool.for_tokens(lm, len(ids) + 1, Precision(precision))
    pool.runner = ModelRunner(lm.model, pool.kv, pool.manager, mode)
    seq = Sequence(ids[:-steps])
    pool.manager.reserve(seq, len(seq))
    pool.runner.forward(seq, len(seq), want_logits=False)
    rows = []
    for token in ids[-steps:]:
        seq.token_ids.append(token)
        pool.manager.reserve(seq, len(seq))
        rows.append(pool.runner.forward(seq, len(seq), want_logits=True))
    return torch.stack(rows)


# max |logit - transformers'| over 64 decode steps past the window, measured per model (int8, fp8,
# k8v4, int4); a test allows twice that, and TOL where a model is exact. Within a window of 64 the
# layers read only the full-precision ring of the newest 64 tokens (layout.WINDOW), so the error
# comes from the global layers (Mistral and Phi-3, every layer windowed, are exact). The tiny Gemma 2,
# with its soft caps and wider weights, has scores large enough for a cap to matter: with its keys
# centred as the other models' are, int8 was off by 0.198 (calibration keeps capped keys uncentred).
# A window of 160 reads quantized rows inside it. int4 since its keys' statistics are per block
# (issue 53); with calibrated keys it measured 0.2006, 0.0056, 0.0065, 0.4120 and 0.0508.
MEASURED = {
    ("gemma2", WINDOW): (0.0118, 0.0504, 0.1359, 0.2161),
    ("gemma3", WINDOW): (0.0003, 0.0013, 0.0048, 0.0045),
    ("mistral-window", WINDOW): (0, 0, 0, 0),
    ("phi3", WINDOW): (0, 0, 0, 0),
    ("qwen2-window", WINDOW): (0.0005, 0.0019, 0.0066, 0.0071),
    ("gemma2", 160): (0.0270, 0.1161, 0.3105, 0.3863),
    ("mistral-window", 160): (0.0028, 0.0121, 0.0515, 0.0513),
}
PRECISIONS = ("int8", "fp8", "k8v4", "int4")


def near_transformers(arch: str, precision: str, window: int) -> None:
    model = tiny_model(arch, sliding_window=window)
    ids = prompt(window + 140, seed=5)
    steps = 64
    expected = model(torch.tensor([ids])).logits[0, -steps:]
    plain = decode_logits(as_loaded(model, IdTokenizer(512)), "fp16", ids, steps)
    got = decode_logits(as_loaded(model, IdTokenizer(512)), precision, ids, steps)
    assert (plain - expected).abs().max().item() <= TOL
    bound = max(2 * MEASURED[arch, window][PRECISIONS.index(precision)], TOL)
    assert (got - expected).abs().max().item() <= bound


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(WINDOWED))
@pytest.mark.parametrize("precision", PRECISIONS)
@torch.inference_mode()
def test_quantized_decode_past_the_window_stays_near_transformers(arch, precision):
    near_transformers(arch, precision, WINDOW)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma2", "mistral-window"])
@pytest.mark.parametrize("precision", PRECISIONS)
@torch.inference_mode()
def test_quantized_rows_inside_a_wider_window_stay_near_transformers(arch, precision):
    near_transformers(arch, precision, 160)


@pytest.mark.slow
def test_the_compiled_decode_step_past_the_window_equals_eager():
    """Gemma 2 has both a window and soft caps: the CPU's compiled step masks and caps in its traced
    attention (fp16) and passes them to the op in its graph (int4). One model: both graphs compile
    at once (``compiled_now``)."""
    lm = as_loaded(tiny_model("gemma2"), IdTokenizer(512), "gemma2")
    ids = prompt(40)
    # int4: the compiled projections round a key's last bit otherwise, which can move its block's
    # minimum or step and so every row of that channel in the block (per-block statistics): 4.3e-4
    for precision, tol in (("fp16", 1e-4), ("int4", 1e-3)):
        want_tokens, want, _ = decode(lm, "eager", precision, ids, WINDOW + 32)
        got_tokens, got, step = decode(lm, "compiled", precision, ids, WINDOW + 32)
        assert step.fallback is None
        assert got_tokens == want_tokens
        assert (got - want).abs().max().item() <= tol
    assert step.replays == 2 * (WINDOW + 32)  # every step of both ran the compiled graph


@pytest.mark.parametrize("arch", sorted(WINDOWED) + sorted(ARCHS))
def test_the_planner_counts_each_architectures_parameters(arch):
    """The model library's fit verdicts and ``kvchat plan`` weigh the weights by this count: Gemma's
    extra norms (and Gemma 3's q/k norms) and Phi-3's fused projections included."""
    from kvchat.core.memory import parameter_counts

    model = tiny_model(arch)
    assert sum(parameter_counts(model.config)) == sum(p.numel() for p in model.parameters())


def test_a_gemma_folder_loads_and_chats_with_a_persona_its_template_has_no_role_for(tmp_path, tokenizer):
    """As a user's Gemma 2 download: a folder with its config, weights and a tokenizer whose
    template refuses the system role. The persona goes to the head of the first user turn, and a
    reply runs past the window."""
    from kvchat.engine.model.loading import load

    from test_chat import NO_SYSTEM

    tiny_model("gemma2", vocab_size=len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"chat_template"', '"unused_template"'))
    (tmp_path / "chat_template.jinja").write_text(NO_SYSTEM)
    lm = load(str(tmp_path))
    assert lm.model.config.model_type == "gemma2"
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there."}]
    prompt = tokenizer.decode(ChatFormatter(lm.tokenizer).encode(messages).token_ids)
    assert prompt == "<start_of_turn>user\nYou are terse.\n\nHello there.<end_of_turn>\n<start_of_turn>model\n"
    engine = Engine(EngineConfig(max_context=512, prefill_chunk=32), loaded=lm)
    done = engine.submit(Request(messages=messages, sampling=SamplingParams(
        max_new_tokens=WINDOW + 16, temperature=0, ignore_eos=True))).result()
    engine.close()
    assert done.finish_reason == "length" and len(done.token_ids) == WINDOW + 16


@torch.inference_mode()
def test_phi_3_minis_head_dim_of_96_runs_at_fp16_and_refuses_the_quantized_precisions_clearly():
    """The quantized precisions rotate each head by a Hadamard matrix, which has no size 96."""
    from kvchat.core.config import ConfigError

    model = tiny_model("phi3", head_dim=96, hidden_size=384)
    ids = prompt(3 * WINDOW)
    runner, mgr = paged_runner(model)
    _, logits = prefill(runner, mgr, ids, 37)
    assert (logits - model(torch.tensor([ids])).logits[0, -1]).abs().max().item() <= TOL
    lm = as_loaded(model, IdTokenizer(512))
    with pytest.raises(ConfigError, match="int8 needs a head_dim that is a power of two; this model's is 96"):
        KVPool.for_tokens(lm, 64, Precision.INT8)
    pool = KVPool.for_tokens(lm, 64, Precision.FP16)
    assert MemoryPolicy(Precision.AUTO, pool.quantizable).rungs() == (Precision.FP16,)  # nothing to step down to
    with pytest.raises(ConfigError, match="power of two"):
        pool.rebuild(Precision.INT4, pool.budget)


def multimodal_gemma_3(text: dict):
    """A Gemma 3 of images and text as the hub's from 4B up (model_type gemma3), its vision tower tiny."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    torch.manual_seed(0)
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                       eos_token_id=[2, 7])).eval()


@pytest.mark.parametrize("prefix", ["language_model.model.", "model.language_model."])
def test_a_multimodal_gemma_3_folder_runs_its_language_model_as_the_whole_model_does_on_text(tmp_path, tokenizer,
                                                                                           prefix):
    """Its language model's weights are under ``prefix`` (the hub's checkpoints, or as a newer
    transformers names them) beside the vision tower's. kvchat loads the language model alone: its
    logits over a prompt longer than the window are the whole model's, its end-of-turn ids the
    wrapper's, and a reply runs."""
    from safetensors.torch import load_file, save_file
    from kvchat.engine.host import eos_token_ids
    from kvchat.engine.model.loading import load

    from tiny_models import COMMON

    whole = multimodal_gemma_3({**COMMON, **WINDOWED["gemma3"][2], "vocab_size": len(tokenizer)})
    whole.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    assert sum(k.startswith("language_model.model.") for k in weights) == len(whole.model.language_model.state_dict())
    save_file({k.replace("language_model.model.", prefix): v for k, v in weights.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").unlink()  # it would say the end-of-turn ids itself
    lm = load(str(tmp_path))
    assert type(lm.model).__name__ == "Gemma3ForCausalLM" and lm.model.config.model_type == "gemma3_text"
    ids = torch.tensor([prompt(2 * WINDOW)])
    with torch.inference_mode():
        assert torch.equal(lm.model(ids).logits, whole(input_ids=ids).logits)
    assert eos_token_ids(lm) >= {2, 7}
    engine = Engine(EngineConfig(max_context=512, prefill_chunk=32), loaded=lm)
    done = engine.submit(Request(messages=[{"role": "user", "content": "Hello there."}], sampling=SamplingParams(
        max_new_tokens=8, temperature=0, ignore_eos=True))).result()
    engine.close()
    assert done.finish_reason == "length" and len(done.token_ids) == 8


def test_the_planner_reads_a_multimodal_gemma_3_config_json_as_transformers_does(tmp_path):
    """gemma-3-4b-it's config.json names only what differs from Gemma3TextConfig's defaults (no
    heads, head size or vocabulary): the planner's counts from it equal those of the config
    transformers makes of it, and the model library plans its badge from it."""
    from kvchat.core.memory import GiB
    from kvchat.core.model_library import describe_folder, fit

    from transformers import Gemma3Config

    from kvchat.core.config import check_model_config
    from kvchat.core.kv_sizes import KVShape
    from kvchat.core.memory import parameter_counts
    from kvchat.core.model_source import SUPPORTED

    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024},
           "vision_config": {"model_type": "siglip_vision_model"}}
    made = Gemma3Config(**hub)
    check_model_config(hub, "gemma-3-4b-it", SUPPORTED)
    assert parameter_counts(hub) == parameter_counts(made)
    assert KVShape.from_config(hub) == KVShape.from_config(made)
    (tmp_path / "config.json").write_text(json.dumps(hub))
    listed = describe_folder(tmp_path, "added")
    assert (listed.parameters, listed.trained_context) == (sum(parameter_counts(made)), 131072)
    assert fit(listed, 24 * GiB, on_cuda=True).kind == "fits"
    assert KVShape.from_config(hub).windows == (1024,) * 5 + (None,) + (1024,) * 5 + (None,) + (1024,) * 5 + \
        (None,) + (1024,) * 5 + (None,) + (1024,) * 5 + (None,) + (1024,) * 4
