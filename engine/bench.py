"""``kvchat bench``: figures side by side in one process, printed, never asserted."""
import json
import platform
import statistics
import time

import torch

from .config import EngineConfig, SamplingParams
from .engine import Engine
from .events import Request
from .models import load


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {torch.get_num_threads()} torch threads, torch {torch.__version__}"


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n,), generator=g).tolist()


def bench_decode(model: str = "starter", prompt_len: int = 512, new_tokens: int = 128, repeats: int = 3) -> dict:
    engine = Engine(EngineConfig(model=model, max_context=prompt_len + new_tokens + 64))
    engine.wait_ready()
    hf = load(model).model  # a second copy, on transformers' own attention and cache
    vocab = hf.config.vocab_size
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    ours_prefill, ours_decode, hf_prefill, hf_decode = [], [], [], []
    for r in range(repeats + 1):  # the first round warms both up and is not counted
        prompt = random_prompt(prompt_len, vocab, seed=r)
        stats = engine.submit(Request(prompt_ids=prompt, sampling=sp)).result().stats
        hf_p, hf_d = _hf_generate(hf, prompt, new_tokens)
        if r:
            ours_prefill.append(prompt_len / (stats.ttft_ms / 1000))
            ours_decode.append(stats.decode_tok_s)
            hf_prefill.append(hf_p)
            hf_decode.append(hf_d)
    engine.close()
    med = statistics.median
    result = {
        "machine": machine(), "model": model, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
        "kvchat_prefill_tok_s": med(ours_prefill), "transformers_prefill_tok_s": med(hf_prefill),
        "kvchat_decode_tok_s": med(ours_decode), "transformers_decode_tok_s": med(hf_decode),
    }
    result["prefill_ratio"] = result["kvchat_prefill_tok_s"] / result["transformers_prefill_tok_s"]
    result["decode_ratio"] = result["kvchat_decode_tok_s"] / result["transformers_decode_tok_s"]
    return result


@torch.inference_mode()
def _hf_generate(model, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of ``generate()`` with its own cache, greedy."""
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, attention_mask=torch.ones_like(ids), pad_token_id=0)
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    t1 = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, **kw)
    t2 = time.perf_counter()
    prefill = t1 - t0
    return len(prompt) / prefill, new_tokens / ((t2 - t1) - prefill)


def print_table(result: dict, rows: list[tuple[str, str, str]]) -> None:
    print(f"machine: {result['machine']}")
    width = max(len(r[0]) for r in rows)
    for label, ours, theirs in rows:
        print(f"  {label:<{width}}  {ours:>12}  {theirs:>12}")


def report_decode(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print_table(result, [
        ("", "kvchat", "transformers"),
        (f"prefill tok/s ({result['prompt_tokens']} tokens)", f"{result['kvchat_prefill_tok_s']:.1f}",
         f"{result['transformers_prefill_tok_s']:.1f}"),
        (f"decode tok/s ({result['new_tokens']} tokens)", f"{result['kvchat_decode_tok_s']:.1f}",
         f"{result['transformers_decode_tok_s']:.1f}"),
    ])
    print(f"  prefill ratio {result['prefill_ratio']:.2f}  (target >= 0.9)")
    print(f"  decode ratio  {result['decode_ratio']:.2f}  (target >= 1.0)")
