"""``kvchat eval``: perplexity and KL divergence of the quantized KV cache against the fp16 one.

Scored as llama.cpp's ``llama-perplexity`` does: the text is cut into non-overlapping windows of
``context`` tokens, and in each only the second half is scored, so every scored token sees at least
half a window. Each window goes through the paged cache in prefill chunks, so the later chunks read
quantized K/V, as a chat does. Token ids come from the model's Hugging Face tokenizer, no BOS.
"""
import math
from pathlib import Path

import torch

from kvchat.core.config import EngineConfig, Precision
from kvchat.core.kv_sizes import KVShape, bytes_per_token
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.model.loading import LoadedModel


def window_logprobs(lm: LoadedModel, tokens: list[int], context: int, precision: Precision, chunk: int):
    """Yield, per window, the log-probabilities ``[context/2 - 1, vocab]`` at the scored positions
    and the ids they predict."""
    pool = KVPool.for_tokens(lm, context, precision)
    manager, runner = pool.manager, pool.runner
    first = context // 2
    for w in range(len(tokens) // context):
        seq = Sequence(tokens[w * context:(w + 1) * context])
        manager.reserve(seq, context)
        rows = []
        while seq.num_computed < context:
            start = seq.num_computed
            logits = runner.forward(seq, min(start + chunk, context), want_logits="all")
            rows.append(logits[max(0, first - start):] if start + len(logits) > first else logits[:0])
        manager.free(seq)
        scored = torch.cat(rows)[:-1]
        yield torch.log_softmax(scored, dim=-1), torch.tensor(seq.token_ids[first + 1:], device=scored.device)


def perplexity(lm: LoadedModel, tokens: list[int], context: int, precision: Precision, chunk: int = 64) -> dict:
    nll, count = 0.0, 0
    for logp, target in window_logprobs(lm, tokens, context, precision, chunk):
        nll -= logp.gather(1, target[:, None]).sum().item()
        count += len(target)
    shape = KVShape.from_config(lm.model.config)
    return {"precision": Precision(precision).value, "ppl": math.exp(nll / count), "scored_tokens": count,
            "bytes_per_token": bytes_per_token(shape, precision),
            "bytes_fraction_of_fp16": bytes_per_token(shape, precision) / bytes_per_token(shape, Precision.FP16)}


def kl_divergence(lm: LoadedModel, tokens: list[int], context: int, precision: Precision, chunk: int = 64,
                  reference: list | None = None) -> dict:
    """Mean and 99th-percentile KL(fp16 || precision) over the scored positions. ``reference``:
    the fp16 pool's ``window_logprobs`` of the same arguments, computed once for several precisions."""
    kls = []
    if reference is None:
        reference = window_logprobs(lm, tokens, context, Precision.FP16, chunk)
    pairs = zip(reference, window_logprobs(lm, tokens, context, precision, chunk))
    for (ref, _), (q, _) in pairs:
        kls.append((ref.exp() * (ref - q)).sum(-1))
    kl = torch.cat(kls)
    return {"precision": Precision(precision).value, "kl_mean": kl.mean().item(),
            "kl_p99": torch.quantile(kl, 0.99).item(), "positions": len(kl)}


LLAMA_CPP = {"fp16": 18.39, "int8": 18.38, "int4": 19.48}  # llama-perplexity -c 512, same GGUF, GPL-3 (q8_0/q4_0)
TEXTS = Path(__file__).parent / "texts"
KINDS = ("prose", "code", "chat", "french")  # the texts shipped in bench/texts (their sources: README.md there)
# never used to choose anything (a statistic, a threshold, a format): reported, not tuned on
HELD_OUT = ("python_reference", "russian", "chinese", "c_code")
SETS = {"shipped": [(k, TEXTS / f"{k}.txt") for k in KINDS],
        "held-out": [(k, TEXTS / "held_out" / f"{k}.txt") for k in HELD_OUT]}


def read_texts(paths: list[str] | None, which: str = "all") -> list[tuple[str, str, str, str]]:
    """(set, kind, path, text) for each file (set "given"); none given: the shipped set, one text
    per kind, and the held-out set (``which``: shipped, held-out or all)."""
    from kvchat.core.config import ConfigError

    if paths:
        named = [("given", Path(p).stem, p) for p in paths]
    else:
        named = [(s, k, str(p)) for s in SETS for k, p in SETS[s] if which in (s, "all")]
    out = []
    for group, kind, path in named:
        try:
            out.append((group, kind, path, Path(path).expanduser().read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from None
    return out


def main(which: str, model: str, text_files: list[str] | None, context: int, precisions: list[str], as_json: bool,
         weights: str = "none", chunk: int | None = None, text_set: str = "all") -> None:
    """Each text (``text_files``, else the shipped prose, code, chat and French and the held-out
    set, or one of them: ``text_set``) against the fp16 cache, for each of ``precisions``. ``weights`` other than none: the baseline is the checkpoint's
    own weights with an fp16 KV cache, against those weights with each precision's cache.
    ``chunk``: the prefill chunk, by default the engine's own, which is how a pasted document
    reaches the cache."""
    import json

    from kvchat.core.config import ConfigError
    from kvchat.engine.model.loading import load
    from kvchat.engine.model.weights import warm_up

    if context < 4 or context % 2:
        raise ConfigError("--context must be an even number >= 4")
    chunk = chunk or EngineConfig().prefill_chunk
    if chunk < 1:
        raise ConfigError("--chunk must be at least 1")
    named = read_texts(text_files, text_set)  # an unreadable file is said before the model loads
    lm = load(model)
    texts = [(group, kind, path, lm.tokenizer(text, add_special_tokens=False)["input_ids"])
             for group, kind, path, text in named]
    for _, _, path, tokens in texts:  # every text checked before any is scored
        if len(tokens) < context:
            raise ConfigError(f"{path} has {len(tokens)} tokens, fewer than one window of {context}")
    other = lm if weights == "none" else load(model, weights=weights)
    warm_up(other.model)  # what the engine's compile thread does first: int8 weights' kernel, as a chat computes
    report = []
    for group, kind, path, tokens in texts:
        if which == "kld":
            rows = [kl_divergence(other, tokens, context, Precision(p), chunk) for p in precisions]
        else:
            base = {**perplexity(lm, tokens, context, Precision.FP16, chunk), "weights": "none"}
            rows = [base] + [{**perplexity(other, tokens, context, Precision(p), chunk), "weights": weights}
                             for p in precisions if p != "fp16" or weights != "none"]
            for r in rows:
                r["increase_pct"] = 100 * (r["ppl"] / base["ppl"] - 1)
        report.append({"set": group, "kind": kind, "text": path, "tokens": len(tokens), "results": rows})
    if as_json:
        print(json.dumps({"context": context, "chunk": chunk, "texts": report}, indent=2))
        return
    print(f"context {context}, prefill chunks of {chunk}; token ids from the Hugging Face tokenizer, no BOS")
    for i, entry in enumerate(report):
        if entry["set"] != "given" and (i == 0 or report[i - 1]["set"] != entry["set"]):
            print({"shipped": "shipped texts (the ones kvchat is tuned on):",
                   "held-out": "held-out texts (never used to choose anything):"}[entry["set"]])
        print(f"{entry['kind']} ({entry['text']}): {entry['tokens']} tokens")
        for r in entry["results"]:
            if which == "kld":
                print(f"  KL(fp16 || {r['precision']}) over {r['positions']} positions: mean {r['kl_mean']:.5f}, "
                      f"p99 {r['kl_p99']:.5f}")
                continue
            gpl3 = Path(entry["text"]).name == "GPL-3"
            ref = LLAMA_CPP.get(r["precision"]) if gpl3 and r["weights"] == "none" and context == 512 else None
            print(f"  weights {r['weights']:<4} KV {r['precision']:<5} ppl {r['ppl']:.3f}  ({r['increase_pct']:+.2f}%)"
                  f"  bytes/token {r['bytes_fraction_of_fp16']:.3f} of fp16  {r['scored_tokens']} scored"
                  + (f"   llama.cpp: {ref}" if ref else ""))


@torch.inference_mode()
def reply_logprobs(pool: KVPool, prompt: list[int], reply: list[int]) -> torch.Tensor:
    """Log-probabilities ``[len(reply), vocab]`` of each reply token's position, decoded one token
    at a time through ``pool`` as a chat decodes it. On a live engine's pool the conversation's
    cached blocks are used as they are: after its conversions, what the reply really read."""
    seq = Sequence(list(prompt))
    manager, runner = pool.manager, pool.runner
    pool.match(seq)  # the prompt's cached rows only (a windowed model's in a ring): the reply is decoded again
    seq.token_ids += reply
    try:
        manager.reserve(seq, len(seq))
        while seq.num_computed < len(prompt) - 1:
            runner.forward(seq, min(seq.num_computed + 512, len(prompt) - 1), want_logits=False)
        rows = [runner.forward(seq, p + 1, want_logits=True) for p in range(len(prompt) - 1, len(seq) - 1)]
    finally:
        manager.free(seq)
    return torch.log_softmax(torch.stack(rows), dim=-1)


def reply_kl(lm: LoadedModel, pool: KVPool, prompt: list[int], reply: list[int]) -> dict:
    """KL(fp16 || ``pool``) over a reply: ``pool`` (an engine's own, converted as the chat went)
    against an unconstrained fp16 pool holding the whole conversation."""
    ref = reply_logprobs(KVPool.for_tokens(lm, len(prompt) + len(reply), Precision.FP16), prompt, reply)
    got = reply_logprobs(pool, prompt, reply)
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"kl_mean": kl.mean().item(), "kl_max": kl.max().item(), "positions": len(kl)}
