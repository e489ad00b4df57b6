"""Tiny random models with GQA and head_dim 64: Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm) in
``ARCHS``; in ``WINDOWED``, those whose layers see a sliding window or soft-cap their scores."""
import copy
import hashlib

import torch
from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MistralConfig, MistralForCausalLM, Phi3Config, Phi3ForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from kvchat.engine.model.loading import LoadedModel
from kvchat.core.model_source import ModelSource

COMMON = dict(vocab_size=512, hidden_size=256, intermediate_size=384, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
ARCHS = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"use_sliding_window": False}),
}
WINDOW = 64
WINDOWED = {
    # every layer windowed, as Mistral 7B v0.1 (4,096)
    "mistral-window": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW}),
    # the layers from max_window_layers on windowed
    "qwen2-window": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": True, "sliding_window": WINDOW,
                                                     "max_window_layers": 1}),
    # local and global layers alternating; queries scaled by 256 ** -0.5, not head_dim's; embeddings
    # scaled by sqrt(hidden). Soft caps on the scores and logits, at sizes these weights reach (5 and
    # 10; Gemma 2's own 50 and 30 would not change these scores): a wider init gives the scores some
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": WINDOW, "initializer_range": 0.1,
                                                 "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
    # five local layers to one global, q/k norms, a local RoPE base
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM, {"sliding_window": WINDOW, "num_hidden_layers": 6}),
    # fused qkv and gate/up projections; a window on every layer, as Phi-3-mini-4k (2,047)
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": WINDOW}),
}


def tiny_model(arch: str, seed: int = 0, **overrides):
    config_cls, model_cls, extra = ARCHS.get(arch) or WINDOWED[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, **extra, **overrides})).eval()
    # random init leaves q/k/v biases at zero; give Qwen2's bias something to do
    for name, p in model.named_parameters():
        if name.endswith("_proj.bias"):
            torch.nn.init.normal_(p, std=0.5)
    return model


def as_loaded(model, tokenizer, name: str = "tiny") -> LoadedModel:
    """The identity names the weights, as a real load's does (the file's hash): the KV tiers key
    blocks by it, and two tiny models under one name restored each other's KV from disk."""
    return LoadedModel(copy.deepcopy(model), tokenizer, ModelSource("folder", name),
                       f"test:{name}:{fingerprint(model)}", torch.device("cpu"), torch.float32)


def fingerprint(model) -> str:
    digest = hashlib.sha256()
    for name, p in model.state_dict().items():  # a sample of each tensor tells random seeds apart
        digest.update(name.encode() + str(tuple(p.shape)).encode() + p.flatten()[:256].float().numpy().tobytes())
    return digest.hexdigest()[:16]


def first_layers(lm: LoadedModel, n: int = 4) -> LoadedModel:
    """A copy of ``lm`` cut to its first ``n`` layers: its shapes (the starter's 9 query heads over 3
    KV heads, head_dim 64), weights and vocabulary, at n/30 of the starter's cost per token. For
    the tests of the engine's own logic (tiers, pressure, steps): what they check does not depend
    on the depth, and the whole starter made each of them 15-28 s."""
    model = copy.deepcopy(lm.model)
    model.model.layers = model.model.layers[:n]
    model.config.num_hidden_layers = n
    return LoadedModel(model, lm.tokenizer, lm.source, f"{lm.identity}|first {n} layers", lm.device, lm.dtype)


def gguf_writer(path, arch: str, layers: int, hidden: int, ffn: int, heads: int, kv: int, context: int = 256):
    """A GGUFWriter with a model's sizes and a gpt2-style tokenizer model set; the caller adds the
    rest and ends it with ``write_gguf``."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_context_length(context)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    return w


def write_gguf(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_gguf(path, layers: int = 2, hidden: int = 64, ffn: int = 128, heads: int = 4, kv: int = 2,
                    vocab: int = 300) -> int:
    """A Llama GGUF of random fp32 weights and a vocabulary of the printable ASCII characters (no
    merges), which transformers' GGUF loader reads as it reads a real one, in a second where the
    starter takes 5-6 s before its first tensor. Returns its number of tensors."""
    import numpy as np

    w = gguf_writer(path, "llama", layers, hidden, ffn, heads, kv)
    chars = [chr(c) for c in range(33, 127)]
    assert vocab >= len(chars) + 2, "the characters and the two special tokens"
    w.add_token_list(chars + [f"<t{i}>" for i in range(vocab - len(chars) - 2)] + ["<|im_start|>", "<|im_end|>"])
    w.add_token_types([1] * (vocab - 2) + [3, 3])
    w.add_token_scores([0.0] * vocab)
    w.add_token_merges([])
    w.add_bos_token_id(vocab - 2)
    w.add_eos_token_id(vocab - 1)
    rng = np.random.default_rng(0)
    tensors = {"token_embd.weight": (vocab, hidden), "output_norm.weight": None}
    for i in range(layers):
        tensors.update({f"blk.{i}.attn_norm.weight": None, f"blk.{i}.attn_q.weight": (hidden, hidden),
                        f"blk.{i}.attn_k.weight": (kv * hidden // heads, hidden),
                        f"blk.{i}.attn_v.weight": (kv * hidden // heads, hidden),
                        f"blk.{i}.attn_output.weight": (hidden, hidden), f"blk.{i}.ffn_norm.weight": None,
                        f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
                        f"blk.{i}.ffn_down.weight": (hidden, ffn)})
    for name, shape in tensors.items():  # None: a norm's weight, ones
        w.add_tensor(name, np.ones(hidden, np.float32) if shape is None
                     else (rng.standard_normal(shape) * 0.02).astype(np.float32))
    write_gguf(w)
    return len(tensors)
