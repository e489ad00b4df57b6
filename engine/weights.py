"""Weight-only quantization on the CPU.

Decode on the CPU is bound by reading the weights: each token reads every linear layer once.
int8 (groups of 32, a bf16 scale each) reads 0.27 of fp32's bytes, int4 (groups of 32 with a scale
and a minimum, the layout of GGUF's Q4_1, through torch's packed kernel) about 0.16. The rest of
the model (norms, residual stream, KV) keeps the model's dtype. The tied input embedding stays as
it is (a lookup reads one row); the output head gets its own quantized copy.
"""
import torch
from torch import nn

INT8_GROUP = 32
INT4_GROUP = 32
_ACT = torch.bfloat16  # what torch's int4 kernel takes


class Int8Linear(nn.Module):
    """``x @ W.T`` with W stored as int8 in groups of ``INT8_GROUP`` along the input, one scale each.

    Per output channel (what ``torch.ops.aten._weight_int8pack_mm`` takes, with bf16 activations)
    cost +0.6% perplexity on the starter, over the +0.5% bar; groups of 32 measured -0.1% (noise).
    So the compiled decode step reads the int8 rows in one pass that inductor fuses (dequantize,
    multiply, sum), as fast as the per-channel kernel; a prefill chunk rebuilds the weight for
    one matrix product.
    """

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        n, k = w.shape
        groups = w.view(n, k // INT8_GROUP, INT8_GROUP)
        scale = (groups.abs().amax(-1) / 127).clamp(min=1e-12).to(torch.bfloat16).float()
        self.register_buffer("qweight", torch.round(groups / scale[..., None]).clamp(-127, 127).to(torch.int8).view(n, k))
        self.register_buffer("scales", scale.to(torch.bfloat16))  # exact: the codes were made against these
        self.bias = linear.bias
        self.in_features, self.out_features = k, n

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        n, k = self.qweight.shape
        groups = self.qweight.view(n, -1, INT8_GROUP).to(dtype) * self.scales.to(dtype)[..., None]
        return groups.view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() == 1 and torch.compiler.is_compiling():
            out = (x.reshape(1, self.in_features) * self.weight_as(x.dtype)).sum(-1)
        else:  # eager, a matrix product: slow for one row, which is why decode compiles
            out = nn.functional.linear(x.reshape(-1, self.in_features), self.weight_as(x.dtype))
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
    group = INT8_GROUP if mode == "int8" else INT4_GROUP
    rows = 16 if mode == "int4" else 1  # torch's int4 packing tiles output rows by 16
    bad = [n for n, m in model.named_modules()
           if isinstance(m, nn.Linear) and (m.in_features % group or m.out_features % rows)]
    if bad:
        raise ValueError(f"{mode} weights need input sizes divisible by {group}"
                         + (f" and output sizes by {rows}" if rows > 1 else "") + f": {bad[0]} is not")
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
