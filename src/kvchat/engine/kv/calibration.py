"""Key statistics for the quantized KV modes, from a fixed text: computed once per loaded model (a
fraction of a second on the starter) and identical on every run, so cached blocks stay valid. The
text mixes the kinds users paste: prose, code, a chat, other languages, a table, JSON, SQL. Against
one English paragraph with a little code, int4's perplexity increase at context 4096 fell from
+1.15% to +0.59% on Python's documentation and from +1.09% to +0.68% on French; code and chat
moved by a tenth of a point (docs/CHANGELOG-performance.md, 2026-12-03).

- centre: the mean key per layer and KV head, subtracted before quantizing (see kernels/quant.py);
- channel scale s: keys are multiplied by s and queries divided by it, which leaves q . k exact and
  spends the 4 bits where the queries look. Minimizing the expected score error
  (sum q_j^2 / s_j^2)(sum s_j^2 var_j) gives s_j = (E[q_j^2] / var_j)^(1/4), normalized to mean 1.
- fp8 scales: per KV head, the largest transformed key and value of the text over ``FP8_TARGET``, so
  a text with values several times larger still fits under e4m3's 448 (the codes keep 3 bits of
  mantissa at any magnitude, so headroom costs nothing until values reach e4m3's subnormals);
  rounded up to a power of two, so dividing by it and multiplying back is exact in any dtype.
"""
import hashlib
import weakref

import torch

from kvchat.core.config import Precision
from kvchat.core.kv_sizes import config_value
from kvchat.engine.kv.manager import Sequence
from kvchat.kernels import quant

FP8_TARGET = quant.FP8_MAX / 8  # the calibration text's largest |K| or |V| lands at half of it to it

CALIBRATION_TEXT = """\
The harbour town woke slowly. Fishing boats came in on the morning tide, and the market stalls
opened one by one: bread, apples, nets, rope, and tea in paper cups. A teacher explained fractions to
a class of nine-year-olds; a programmer fixed a bug in a sorting function and wrote a test for it.
def mean(values):
    return sum(values) / len(values)
In 1887 the lighthouse was rebuilt after a storm. Its lamp burned paraffin until 1952, then
electricity. Questions people ask the librarian: Where are the maps? How do I renew a book? Can you
recommend a novel about the sea? The answer, usually, is yes - and a cup of tea.
User: My script crashes with KeyError: 'name' when the JSON has no name field. How do I fix it?
Assistant: Use data.get("name", "unknown") instead of data["name"]; get returns the default when the key is missing.
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
for i in range(10):
    print(f"{i:>3} {i * i:>5}")
Le marché ouvre à huit heures. Les pêcheurs vendent leurs poissons sur le quai, et les enfants courent
entre les étals. Der Zug nach Berlin fährt um 9.15 Uhr ab Gleis 4. El museo está cerrado los lunes.
| name  | price | qty |
|-------|-------|-----|
| apple | 0.50  | 12  |
{"id": 17, "tags": ["red", "fruit"], "price": 0.5, "in_stock": true}
SELECT name, COUNT(*) FROM orders WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
"""
# in the prefix cache's key: blocks quantized with other statistics are other bytes
CALIBRATION_ID = hashlib.sha256(CALIBRATION_TEXT.encode()).hexdigest()[:12]


# per model: every pool of a model (a precision change, `kvchat eval`'s pool per text and precision)
# gets the same figures, and computing them costs 1.5 s on the starter on one thread
_STATS = weakref.WeakKeyDictionary()


def calibrate(lm, scratch_pool):
    """The model's key statistics (``measure``), computed once per model."""
    if lm.model not in _STATS:
        _STATS[lm.model] = measure(lm, scratch_pool)
    return _STATS[lm.model]


@torch.inference_mode()
def measure(lm, scratch_pool):
    """Per layer: key centre ``[kv_heads, D]``, channel scale ``[kv_heads, D]`` and fp8 scales
    ``[2, kv_heads]`` (K, V), from the keys, values and queries of the calibration text run through
    ``scratch_pool(lm, tokens, Precision.FP16)``, a new fp16 pool (the pool's own constructor: the
    pool calls this when it first needs a quantized layout)."""
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
    centers, scales, fp8 = [], [], []
    rotation = quant.hadamard(pool.shape.head_dim, lm.device)
    # keys are stored less their centre, which shifts each query's scores by q.c: softmax does not
    # see a shift, but a soft cap (Gemma 2) does, so capped layers keep their keys uncentred
    capped = bool(config_value(lm.model.config, "attn_logit_softcapping"))
    for i, layer in enumerate(pool.kv.layers):
        k, v = (layer[n].index_select(0, order).flatten(0, 1)[:len(ids)].float() for n in ("k", "v"))
        c = k.mean(0) if not capped else torch.zeros_like(k[0])
        var = ((k - c) ** 2).mean(0)
        q2 = (qs[i] ** 2).unflatten(1, (k.shape[1], -1)).mean((0, 2))  # per KV head, over its query group
        s = (q2 / var.clamp(min=1e-6)) ** 0.25
        s = s / s.mean(-1, keepdim=True)
        centers.append(c)
        scales.append(s)
        largest = [x.abs().amax((0, 2)) for x in (quant.transform_keys(k, rotation, c, s), quant.rotate(v, rotation))]
        fp8.append(torch.exp2(torch.ceil(torch.log2((torch.stack(largest) / FP8_TARGET).clamp(min=2.0 ** -20)))))
    return centers, scales, fp8
