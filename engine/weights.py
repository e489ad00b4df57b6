"""Weight-only quantization on the CPU, through torch's own packed kernels.

Decode on the CPU is bound by reading the weights: each token reads every linear layer once.
int8 (one scale per output channel) reads a quarter of fp32's bytes, int4 (groups of 32 with a scale
and a minimum, the layout of GGUF's Q4_1) an eighth. torch's kernels for both want bf16
activations, so each layer casts its input to bf16 and its output back; the rest of the model
(norms, residual stream, KV) keeps the model's dtype. The tied input embedding stays as it is (a
lookup reads one row); the output head gets its own quantized copy.
"""
import torch
from torch import nn

CPU_MODES = ("none", "bf16", "int8", "int4")
INT4_GROUP = 32
_ACT = torch.bfloat16  # what the packed kernels take


class Int8Linear(nn.Module):
    """``x @ W.T`` with W stored as int8 rows and one scale per output channel (symmetric)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        # the kernel takes bf16 scales: round them first and quantize against the rounded ones,
        # so that rounding a scale moves no weight (it cost +0.6% perplexity on the starter)
        scale = (w.abs().amax(1) / 127).clamp(min=1e-12).to(_ACT)
        self.register_buffer("qweight", torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scale)
        self.register_buffer("row_scales", scale.float())
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.shape[:-1].numel() == 1:
            # the compiled decode step: inductor fuses this into one pass over the int8 rows, with
            # the activations and the sums in the model's dtype (no bf16 rounding), and it measured
            # faster than the packed kernel (lm_head: 1.9 ms against 3.9 ms on one core)
            out = (x.reshape(1, self.in_features) * self.qweight.to(x.dtype)).sum(-1) * self.row_scales.to(x.dtype)
        else:
            flat = x.reshape(-1, self.in_features).to(_ACT)
            out = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


class Int4Linear(nn.Module):
    """``x @ W.T`` with W in groups of ``INT4_GROUP`` along the input: ``w = q * scale + min``,
    ``q`` in 0..15. torch's kernel computes ``(q - 8) * scale + zero``, so ``zero = min + 8 scale``."""

    def __init__(self, linear: nn.Linear, inner_k_tiles: int = 2):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(-1), groups.amax(-1)
        # scale and zero as the kernel will hold them (bf16), and the codes against those
        scale = ((high - low) / 15).clamp(min=1e-12).to(_ACT).float()
        zero = (low + 8 * scale).to(_ACT).float()
        q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).view(n, k).to(torch.int32)
        self.register_buffer("qweight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, inner_k_tiles))
        self.register_buffer("scales_and_zeros", torch.stack([scale, zero], -1).transpose(0, 1).contiguous().to(_ACT))
        self.bias = linear.bias
        self.in_features, self.out_features = k, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(_ACT)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, INT4_GROUP, self.scales_and_zeros)
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out


def quantize_linears(model: nn.Module, mode: str) -> nn.Module:
    """Replace every ``nn.Linear`` (the output head included) by its ``mode`` twin, in place."""
    if mode not in ("int8", "int4"):
        raise ValueError(f"weight mode must be int8 or int4, not {mode!r}")
    make = Int8Linear if mode == "int8" else Int4Linear
    if mode == "int4":
        bad = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and m.in_features % INT4_GROUP]
        if bad:
            raise ValueError(f"int4 weights need input sizes divisible by {INT4_GROUP}: {bad[0]} is not")
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, make(child))
    model.config.tie_word_embeddings = False  # the head is its own tensor now
    return model


def weight_bytes(model: nn.Module) -> int:
    """Bytes a decode step reads from weights: every tensor once (tied ones once), but of an input
    embedding that the head does not share, only the one row a step looks up."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    if head is None or head.data_ptr() != embed.data_ptr():
        total -= (embed.shape[0] - 1) * embed.shape[1] * embed.element_size()
    return total
