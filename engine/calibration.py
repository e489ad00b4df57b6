"""The key centres of the quantized KV modes: the mean key of each layer and KV head over a fixed
text, computed once per loaded model (a fraction of a second) and the same on every run."""
import torch

from .block_pool import BlockPool
from .config import Precision
from .kv_cache import KVCache, KVShape
from .kv_manager import KVCacheManager, Sequence
from .runner import ModelRunner

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
def key_centers(model, tokenizer, device, dtype) -> list[torch.Tensor]:
    """Per layer ``[kv_heads, head_dim]``, fp32."""
    ids = tokenizer(CALIBRATION_TEXT, add_special_tokens=False)["input_ids"]
    shape, bs = KVShape.from_config(model.config), 16
    blocks = -(-len(ids) // bs)
    kv = KVCache(shape, blocks, bs, dtype, device, Precision.FP16)
    manager = KVCacheManager(BlockPool(blocks), bs, "calibration")
    seq = Sequence(ids)
    manager.reserve(seq, len(ids))
    ModelRunner(model, kv, manager).forward(seq, len(ids), want_logits=False)
    order = torch.tensor([b.id for b in seq.blocks], device=device)
    return [layer["k"].index_select(0, order).flatten(0, 1)[:len(ids)].float().mean(0) for layer in kv.layers]
