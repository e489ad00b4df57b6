"""Key statistics for the quantized KV modes, from a fixed text: computed once per loaded model (a
fraction of a second on the starter) and identical on every run, so cached blocks stay valid.

- centre: the mean key per layer and KV head, subtracted before quantizing (see kernels/quant.py);
- channel scale s: keys are multiplied by s and queries divided by it, which leaves q . k exact and
  spends the 4 bits where the queries look. Minimizing the expected score error
  (sum q_j^2 / s_j^2)(sum s_j^2 var_j) gives s_j = (E[q_j^2] / var_j)^(1/4), normalized to mean 1.
"""
import torch

from kvchat.core.config import Precision
from kvchat.engine.kv.manager import Sequence

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in on the morning tide, and the market stalls
opened one by one: bread, apples, nets, rope, and tea in paper cups. A teacher explained fractions to
a class of nine-year-olds; a programmer fixed a bug in a sorting function and wrote a test for it.
def mean(values):
    return sum(values) / len(values)
In 1887 the lighthouse was rebuilt after a storm. Its lamp burned paraffin until 1952, then
electricity. Questions people ask the librarian: Where are the maps? How do I renew a book? Can you
recommend a novel about the sea? The answer, usually, is yes - and a cup of tea.
"""


@torch.inference_mode()
def calibrate(lm, scratch_pool):
    """Per layer: key centre ``[kv_heads, D]`` and channel scale ``[kv_heads, D]``, from the keys and
    queries of the calibration text run through ``scratch_pool(lm, tokens, Precision.FP16)``, a new
    fp16 pool (the pool's own constructor: the pool calls this when it first needs a quantized layout)."""
    ids = lm.tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
    pool = scratch_pool(lm, len(ids), Precision.FP16)
    seq = Sequence(ids)
    pool.manager.reserve(seq, len(ids))
    qs = {}
    real = pool.kv.attend

    def record_queries(layer, query, *args, **kwargs):
        qs[layer] = query.float()
        return real(layer, query, *args, **kwargs)

    pool.kv.attend = record_queries
    pool.runner.forward(seq, len(ids), want_logits=False)
    order = torch.tensor([b.id for b in seq.blocks], device=lm.device)
    centers, scales = [], []
    for i, layer in enumerate(pool.kv.layers):
        k = layer["k"].index_select(0, order).flatten(0, 1)[:len(ids)].float()
        c = k.mean(0)
        var = ((k - c) ** 2).mean(0)
        q2 = (qs[i] ** 2).unflatten(1, (k.shape[1], -1)).mean((0, 2))  # per KV head, over its query group
        s = (q2 / var.clamp(min=1e-6)) ** 0.25
        centers.append(c)
        scales.append(s / s.mean(-1, keepdim=True))
    return centers, scales
