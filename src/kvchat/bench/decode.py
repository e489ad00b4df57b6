"""``kvchat bench decode``: kvchat's decode step, eager and compiled, and transformers' ``generate()``
on the same model in one process, each against the memory-bandwidth roofline.

Decode reads every weight once per token, and the cached K/V of the context: bytes per token over
the bandwidth measured here is the fastest a token can be. ``--random-weights CONFIG`` builds a
model of that shape with random weights (speed does not depend on their values), so a GPU check
needs no download.
"""
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from kvchat.bench.engine import cpu_build, describe_cpu_build, machine
from kvchat.core.config import Precision
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool, kv_dtype
from kvchat.engine.model.loading import LoadedModel, load, pick_device, pick_dtype
from kvchat.core.model_source import ModelSource
from kvchat.engine.model.runner import ModelRunner
from kvchat.engine.model.weights import Int4Linear, Int8Linear, quantize_linears, weight_bytes

PATHS = ("eager", "compiled", "transformers")


def log(message: str) -> None:
    print(f"bench decode: {message}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, gib: float = 1.0) -> float:
    """Bytes/s of a sum over a tensor far larger than any cache: the best of 5 runs."""
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=device)
    best = math.inf
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        x.sum()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best


class IdTokenizer:
    """Stands in for a tokenizer beside random weights: text to ids by its bytes (what calibration
    needs), ids to placeholder text."""

    eos_token_id = None  # random weights: nothing to stop at

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [3 + b % (self.vocab - 3) for b in text.encode()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(0x4E00 + i % 20000) for i in ids)  # one printable character per id


def random_model(config_path: str, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM

    if Path(config_path).is_dir():
        config = AutoConfig.from_pretrained(config_path)
    else:
        fields = json.loads(Path(config_path).read_text())
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    for p in model.parameters():  # default init gives huge activations in bf16 at 8B; shape is what counts
        p.data.normal_(0, 0.02) if p.dim() > 1 else p.data.fill_(1.0)
    return LoadedModel(model, IdTokenizer(config.vocab_size), ModelSource("random", config_path),
                       f"random:{config_path}", device, dtype)


def model_for(spec: str, random_weights: str | None, device: str, dtype: str, weights: str) -> LoadedModel:
    if not random_weights:
        return load(spec, device, dtype, weights)
    dev = pick_device(device)
    lm = random_model(random_weights, dev, pick_dtype(dtype, dev))
    if weights in ("int8", "int4") and dev.type == "cpu":
        quantize_linears(lm.model, weights)
    elif weights == "nf4" and dev.type == "cuda":
        nf4_linears(lm.model)
    elif weights != "none":
        raise ValueError(f"--random-weights takes weights none, int8 or int4 on the CPU, nf4 on CUDA, not {weights}")
    return lm


def nf4_linears(model) -> None:
    """bitsandbytes NF4 for every linear layer but the head, as transformers' 4-bit loading does."""
    import bitsandbytes as bnb

    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and child is not model.get_output_embeddings():
                q = bnb.nn.Linear4bit(child.in_features, child.out_features, child.bias is not None,
                                      compute_dtype=child.weight.dtype, quant_type="nf4")
                q.weight = bnb.nn.Params4bit(child.weight.data.cpu(), requires_grad=False, quant_type="nf4")
                setattr(module, name, q.to(child.weight.device))


@torch.inference_mode()
def kvchat_round(lm: LoadedModel, pool: KVPool, runner: ModelRunner, prompt: list[int], new_tokens: int):
    """(prefill tok/s, decode tok/s, greedy tokens) through kvchat's pool and decode step."""
    seq = Sequence(list(prompt))
    pool.manager.reserve(seq, len(prompt))
    sync(lm.device)
    t0 = time.perf_counter()
    while seq.num_computed < len(prompt):
        end = min(seq.num_computed + 512, len(prompt))
        logits = runner.forward(seq, end, want_logits=end == len(prompt))
    token = int(logits.argmax())
    t1 = time.perf_counter()
    out = [token]
    for _ in range(new_tokens):
        seq.token_ids.append(token)
        pool.manager.reserve(seq, len(seq))
        token = int(runner.forward(seq, len(seq), want_logits=True).argmax())  # the sampler's sync, as in a chat
        out.append(token)
    t2 = time.perf_counter()
    pool.manager.free(seq)
    return len(prompt) / (t1 - t0), new_tokens / (t2 - t1), out


@torch.inference_mode()
def transformers_round(lm: LoadedModel, prompt: list[int], new_tokens: int):
    """(prefill tok/s, decode tok/s) of ``generate()`` with its own cache and attention, greedy."""
    model = lm.model
    model.set_attn_implementation("sdpa")
    try:
        ids = torch.tensor([prompt], device=lm.device)
        kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
        sync(lm.device)
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync(lm.device)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kw)
        sync(lm.device)
        t2 = time.perf_counter()
    finally:
        from kvchat.engine.model.attention import ATTN_NAME
        model.set_attn_implementation(ATTN_NAME)
    prefill = t1 - t0
    return len(prompt) / prefill, new_tokens / ((t2 - t1) - prefill)


def bench_decode(model: str = "starter", random_weights: str | None = None, device: str = "auto",
                 dtype: str = "auto", weights: str = "none", kv_precision: str = "fp16", prompt_len: int = 512,
                 new_tokens: int = 128, repeats: int = 3, paths=PATHS) -> dict:
    lm = model_for(model, random_weights, device, dtype, weights)
    precision = Precision(kv_precision)
    dev = lm.device
    log(f"{lm.source.label} on {dev}, {lm.dtype}, weights {weights}; measuring bandwidth")
    bandwidth = read_bandwidth(dev, 4.0 if dev.type == "cuda" else 1.0)
    shape = KVShape.from_config(lm.model.config)
    w_bytes = weight_bytes(lm.model)
    mean_context = prompt_len + new_tokens / 2
    kv_bytes = mean_context * bytes_per_token(shape, precision, kv_dtype(lm).itemsize)
    token_bytes = w_bytes + kv_bytes
    vocab = lm.model.config.vocab_size
    result = {"machine": _machine(dev), "model": lm.source.label, "device": str(dev), "dtype": str(lm.dtype),
              "weights": weights, "kv_precision": precision.value, "prompt_tokens": prompt_len,
              "new_tokens": new_tokens, "bandwidth_gb_s": bandwidth / 1e9, "weight_bytes": w_bytes,
              "kv_bytes_per_token": kv_bytes, "bytes_per_token": token_bytes,
              "roofline_tok_s": bandwidth / token_bytes, "paths": {}}
    tokens = {}
    # transformers runs the checkpoint's own weights: the peer a user would otherwise run
    quantized = any(isinstance(m, (Int8Linear, Int4Linear)) for m in lm.model.modules())
    own = weights == "none" or (weights == "auto" and not quantized)
    reference = lm if own or "transformers" not in paths else model_for(model, random_weights, device, dtype, "none")
    for path in paths:
        prefill, decode = [], []
        if path != "transformers":
            pool = KVPool.for_tokens(lm, prompt_len + new_tokens + 1, precision)
            runner = ModelRunner(lm.model, pool.kv, pool.manager, path)
            started = time.perf_counter()
            runner.step.prepare(pool.kv)  # the engine compiles in the background; a bench waits for it
            runner.step.background.wait()
            result.setdefault("prepare_s", {})[path] = round(time.perf_counter() - started, 2)
        for r in range(repeats + 1):  # round 0 warms up (compiles, captures) and is not counted
            prompt = torch.randint(100, vocab - 100, (prompt_len,), generator=torch.Generator().manual_seed(r)).tolist()
            if path == "transformers":
                p, d = transformers_round(reference, prompt, new_tokens)
            else:
                t = time.perf_counter()
                p, d, out = kvchat_round(lm, pool, runner, prompt, new_tokens)
                if r == 0:
                    result.setdefault("first_round_s", {})[path] = time.perf_counter() - t
                    tokens[path] = out
                    if runner.step.fallback:
                        result.setdefault("notes", []).append(runner.step.fallback)
            if r:
                prefill.append(p)
                decode.append(d)
            log(f"{path} round {r}: prefill {p:.1f} tok/s, decode {d:.1f} tok/s")
        d = statistics.median(decode)
        roofline = result["roofline_tok_s"]
        if path == "transformers" and reference is not lm:  # its own weights, its KV in the model's dtype
            roofline = bandwidth / (weight_bytes(reference.model)
                                    + mean_context * bytes_per_token(shape, Precision.FP16, kv_dtype(reference).itemsize))
        result["paths"][path] = {"prefill_tok_s": statistics.median(prefill), "decode_tok_s": d,
                                 "roofline_fraction": d / roofline}
    result["weights_chosen"] = getattr(lm.model.config, "kvchat_weights", weights)  # what auto picked
    result["weights_why"] = getattr(lm.model.config, "kvchat_weights_why", None)
    if dev.type == "cpu":
        result["cpu_build"] = cpu_build(lm.model)
    ours = result["paths"]
    if "eager" in ours and "compiled" in ours:
        result["compiled_vs_eager"] = ours["compiled"]["decode_tok_s"] / ours["eager"]["decode_tok_s"]
        result["compiled_tokens_equal_eager"] = tokens["eager"] == tokens["compiled"]
    if "transformers" in ours and "compiled" in ours:
        result["compiled_vs_transformers"] = ours["compiled"]["decode_tok_s"] / ours["transformers"]["decode_tok_s"]
    return result


def _machine(dev: torch.device) -> str:
    return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}" if dev.type == "cuda" else machine()


def report(r: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(r, indent=2))
        return
    print(f"machine: {r['machine']}")
    chosen = f" -> {r['weights_chosen']}" if r.get("weights_chosen") not in (None, r["weights"]) else ""
    print(f"model: {r['model']} ({r['dtype']}, weights {r['weights']}{chosen}), KV {r['kv_precision']}, "
          f"{r['prompt_tokens']}-token prompt, {r['new_tokens']} new tokens")
    print(f"bandwidth {r['bandwidth_gb_s']:.1f} GB/s; bytes/token {r['bytes_per_token'] / 1e6:.1f} MB "
          f"(weights {r['weight_bytes'] / 1e6:.1f}, KV {r['kv_bytes_per_token'] / 1e6:.1f}); "
          f"roofline {r['roofline_tok_s']:.1f} tok/s")
    print(f"  {'path':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'of roofline':>13}")
    for name in PATHS:
        p = r["paths"].get(name)
        if p:
            print(f"  {name:<14}{p['prefill_tok_s']:>15.1f}{p['decode_tok_s']:>14.1f}{p['roofline_fraction']:>12.0%}")
    for key in ("compiled_vs_eager", "compiled_vs_transformers"):
        if key in r:
            print(f"  {key.replace('_', ' ')}: {r[key]:.2f}x")
    if "compiled_tokens_equal_eager" in r:
        print(f"  compiled greedy tokens equal eager's: {r['compiled_tokens_equal_eager']}")
    if r.get("weights_why"):
        print(f"  auto weights: {r['weights_why']}")
    if r.get("cpu_build"):
        print(f"  {describe_cpu_build(r['cpu_build'])}")
    for note in r.get("notes", []):
        print(f"  note: {note}")
