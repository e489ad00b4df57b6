"""``kvchat eval``: perplexity and KL divergence of the quantized KV cache against the fp16 one.

Scored as llama.cpp's ``llama-perplexity`` does: the text is cut into non-overlapping windows of
``context`` tokens, and in each only the second half is scored, so every scored token sees at least
half a window. Each window goes through the paged cache in prefill chunks, so the later chunks read
quantized K/V, as a chat does. Token ids come from the model's Hugging Face tokenizer, no BOS.
"""
import math

import torch

from .block_pool import BlockPool
from .calibration import key_centers
from .config import Precision
from .kv_cache import KVCache, KVShape, bytes_per_token
from .kv_manager import KVCacheManager, Sequence
from .models import LoadedModel
from .runner import ModelRunner


def window_logprobs(lm: LoadedModel, tokens: list[int], context: int, precision: Precision, chunk: int):
    """Yield, per window, the log-probabilities ``[context/2 - 1, vocab]`` at the scored positions
    and the ids they predict."""
    shape, bs = KVShape.from_config(lm.model.config), 16
    num_blocks = -(-context // bs)
    kv = KVCache(shape, num_blocks, bs, lm.dtype, lm.device, precision)
    if kv.format.quantized:
        kv.k_centers = key_centers(lm.model, lm.tokenizer, lm.device, lm.dtype)
    manager = KVCacheManager(BlockPool(num_blocks), bs, "eval")
    runner = ModelRunner(lm.model, kv, manager)
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


def kl_divergence(lm: LoadedModel, tokens: list[int], context: int, precision: Precision, chunk: int = 64) -> dict:
    """Mean and 99th-percentile KL(fp16 || precision) over the scored positions."""
    kls = []
    pairs = zip(window_logprobs(lm, tokens, context, Precision.FP16, chunk),
                window_logprobs(lm, tokens, context, precision, chunk))
    for (ref, _), (q, _) in pairs:
        kls.append((ref.exp() * (ref - q)).sum(-1))
    kl = torch.cat(kls)
    return {"precision": Precision(precision).value, "kl_mean": kl.mean().item(),
            "kl_p99": torch.quantile(kl, 0.99).item(), "positions": len(kl)}
