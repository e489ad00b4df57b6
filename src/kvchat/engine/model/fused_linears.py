"""Linears that read the same rows, run as one int8 (or 4-bit) product: a layer's q, k and v projections, and
its MLP's gate and up. The starter's token then calls the int8 kernel 121 times instead of 211,
each call about 7 us of dispatch and Python and a fork and join of its threads.

transformers' modules call ``q_proj(x)``, ``k_proj(x)``, ``v_proj(x)`` in turn (``gate_proj`` and
``up_proj`` likewise), so each keeps its name and place: the first of a group to see rows runs the
fused product for all, and its siblings, called with those same rows, take their columns; a part
called with other rows runs the group's product for them. The kernel computes each output from
its row and its codes alone, so a part's columns equal what its own layer gave, bit for bit.
"""
import torch
from torch import nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Pending:
    """The group's last fused product, ``(rows, outputs)``, for the parts after the first. One
    tuple, read once into a local: the compile thread traces the same modules while the engine
    thread steps, and a part must never see one thread's rows beside the other's outputs."""

    def __init__(self):
        self.state = None


class GroupPart(nn.Module):
    """One linear of a group: its columns ``start:end`` of the group's fused int8 or 4-bit linear. Only the
    first part registers the fused module (the model's state holds it once)."""

    def __init__(self, fused: nn.Module, start: int, end: int, index: int, sizes: list[int], pending: _Pending):
        super().__init__()
        if index == 0:
            self.fused = fused
        else:
            object.__setattr__(self, "fused", fused)
        self.start, self.end, self.index, self.sizes, self.pending = start, end, index, sizes, pending
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The first part always runs the group's product (it reads nothing another call left, so
        a compiled graph guards on no stash); the others take its columns when they get its rows,
        and the last lets them go."""
        if self.index > 0:
            state = self.pending.state
            if state is not None and state[0] is x:
                if self.index == len(self.sizes) - 1:
                    self.pending.state = None
                return state[1][self.index]
        outputs = self.fused(x).split(self.sizes, -1)
        self.pending.state = (x, outputs) if len(self.sizes) > 1 else None
        return outputs[self.index]

    def weight_as(self, dtype: torch.dtype) -> torch.Tensor:
        return self.fused.weight_as(dtype)[self.start:self.end]


def fuse(module: nn.Module, names: tuple[str, ...], packed_fits, make) -> bool:
    """Replace ``module``'s linears ``names`` (plain ``nn.Linear`` of one input size) by the parts
    of one fused linear that ``make`` quantizes (``Int8Linear`` or ``Int4Linear``, in the kernel's
    layout); False, untouched, where they are not such or the kernel would not take the fused
    shape (``packed_fits(n, k)``)."""
    linears = [getattr(module, name, None) for name in names]
    if not all(type(lin) is nn.Linear for lin in linears) or len({lin.in_features for lin in linears}) != 1:
        return False
    sizes = [lin.out_features for lin in linears]
    if any(size % 16 for size in sizes) or not packed_fits(sum(sizes), linears[0].in_features):
        return False
    whole = nn.Linear(linears[0].in_features, sum(sizes), bias=any(lin.bias is not None for lin in linears),
                      device="meta")
    whole.weight = nn.Parameter(torch.cat([lin.weight.detach() for lin in linears]), requires_grad=False)
    if whole.bias is not None:
        whole.bias = nn.Parameter(torch.cat([lin.bias.detach() if lin.bias is not None
                                             else torch.zeros(lin.out_features, dtype=lin.weight.dtype)
                                             for lin in linears]), requires_grad=False)
    fused = make(whole, packed=True)
    pending, start = _Pending(), 0
    for index, (name, size) in enumerate(zip(names, sizes)):
        setattr(module, name, GroupPart(fused, start, start + size, index, sizes, pending))
        start += size
    return True


def fuse_groups(model: nn.Module, packed_fits, make) -> int:
    """Every group of ``GROUPS`` found in ``model``'s modules fused; how many were."""
    done = 0
    for module in list(model.modules()):
        for names in GROUPS:
            done += fuse(module, names, packed_fits, make)
    return done
