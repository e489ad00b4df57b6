"""Auto weights on the CPU, chosen by measurement: the products of one token in each weight mode,
timed on this machine for the model's shapes, before the model loads.

Which mode decodes fastest depends on the CPU, not only on the bytes read: on an AVX2 machine
inductor's int8 loops built by g++ ran at half the speed of the checkpoint's own fp32 weights, and
bf16 is fast only where the CPU multiplies bf16. A decode step reads every weight once, and its
products are what the weight mode changes, so they are what is timed: each mode's matrices for a
token (enough layers to stream from memory, not from cache, and the output head), one row each,
as the decode step runs them. The answer is kept per machine, kernel build and shapes in the
cache dir, so a later start does not measure again.
"""
import hashlib
import json
import logging
import math
import os
import platform
import time

import torch
from torch.nn import functional as F

from kvchat.core.paths import cache_dir
from kvchat.kernels import cpu_isa, int8_rows

log = logging.getLogger("kvchat.weight_speed")

STREAM_BYTES = 192 << 20  # weights timed per mode: past every cache, so they stream from memory
BYTES_PER_WEIGHT = {"none": 4, "int8": 1 + 2 / 32, "int4": 0.5 + 4 / 32}
MARGIN = 1.05  # a quantized mode must be this much faster than the checkpoint's own weights to be picked
SAME = 1.05  # int4's products within this of int8's count as as fast (it reads 0.63 of the bytes)
LABELS = {"none": "fp32", "int8": "int8", "int4": "int4"}


def token_shapes(config) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """One layer's linears as (outputs, inputs), the layer count and the output head."""
    text = getattr(config, "text_config", None) or config
    hidden, layers = text.hidden_size, text.num_hidden_layers
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    inter = text.intermediate_size
    layer = [(heads * head_dim, hidden), (kv * head_dim, hidden), (kv * head_dim, hidden), (hidden, heads * head_dim),
             (inter, hidden), (inter, hidden), (hidden, inter)]
    return layer, layers, (text.vocab_size, hidden)


def fused(layer: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A layer's products as fused_linears runs them: q/k/v and gate/up one each."""
    q, k, v, o, gate, up, down = layer
    return [(q[0] + k[0] + v[0], q[1]), o, (gate[0] + up[0], gate[1]), down]


def fit_the_kernel(config) -> bool:
    """Whether every matrix of a token, fused or not, has the kernel's shape (a vocabulary of 32001
    does not): a mode whose products would partly run elsewhere is not offered."""
    layer, _, head = token_shapes(config)
    return all(int8_rows.fits(n, k) for n, k in layer + fused(layer) + [head])


def candidates(compiled: bool, four_bit: bool = False) -> list[str]:
    """The modes within their quality bar that may decode fast here: the checkpoint's own; int8
    (+0.0 to +0.5 % perplexity on four kinds of text) where its kernel runs; and int4 there too
    when the checkpoint is stored in 4 bits (a GGUF's Q4_0 or Q4_1: its codes are found
    again). On other checkpoints 4 bits cost +5.5 %, and bf16's cost is not measured: both are
    left to the user."""
    if not (compiled and int8_rows.cpu_supported()):
        return ["none"]
    return ["none", "int8"] + (["int4"] if four_bit else [])


def _matrices(mode: str, shapes: list[tuple[int, int]]) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for n, k in shapes:
        if mode == "int4":
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
            scales = torch.full((n, k // 32), 1e-3).to(torch.bfloat16)
            out.append(int8_rows.pack4(codes, scales, scales))
        elif mode == "int8":
            codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            scales = torch.full((n, k // 32), 1e-3).to(torch.bfloat16)
            out.append(int8_rows.pack(codes, scales))
        else:
            out.append(torch.empty(n, k).uniform_(-0.05, 0.05, generator=g))
    return out


def _product(mode: str):
    if mode == "int4":
        return lambda x, w: torch.ops.kvchat.int4_rows(x, *w)
    if mode == "int8":
        return lambda x, w: torch.ops.kvchat.int8_rows(x, *w)
    return F.linear


@torch.inference_mode()
def time_token(mode: str, config, rounds: int = 3) -> float:
    """Seconds of one token's products in ``mode``: the layers timed (as many as stream from
    memory), scaled to the model's count, plus the head."""
    layer, layers, head = token_shapes(config)
    if mode != "none":
        layer = fused(layer)
    # each mode's own bytes past the caches: sized from fp32's, int4 would be timed from a large L3
    layer_bytes = sum(n * k for n, k in layer) * BYTES_PER_WEIGHT[mode]
    timed = max(1, min(layers, math.ceil(STREAM_BYTES / layer_bytes)))
    # the head stays int8 in int4 mode (weights.quantize_linears)
    mats = _matrices(mode, layer * timed) + _matrices("int8" if mode == "int4" else mode, [head])
    product, head_product = _product(mode), _product("int8" if mode == "int4" else mode)
    rows = {k: torch.randn(1, k) for _, k in layer + [head]}
    shapes = layer * timed + [head]
    best_layers = best_head = math.inf
    for _ in range(rounds + 1):  # the first round warms up (pages, a first call's set-up)
        start = time.perf_counter()
        for (_, k), w in zip(shapes[:-1], mats[:-1]):
            product(rows[k], w)
        middle = time.perf_counter()
        head_product(rows[head[1]], mats[-1])
        end = time.perf_counter()
        best_layers, best_head = min(best_layers, middle - start), min(best_head, end - middle)
    return best_layers * layers / timed + best_head


def _key(config, modes: list[str]) -> str:
    from kvchat.engine.model.kernel_build import kernel_identity

    layer, layers, head = token_shapes(config)
    # the kernel's identity names its source, compiler and torch: a changed kernel is timed again
    machine = [platform.machine(), _cpu_name(), cpu_isa.chosen() or "none", torch.backends.cpu.get_cpu_capability(),
               str(torch.get_num_threads()), kernel_identity()]
    text = json.dumps([machine, layer, layers, head, modes])
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return platform.processor()


def _store():
    return cache_dir() / "weight_speed.json"


def choose(config, compiled: bool, four_bit: bool = False) -> tuple[str, str]:
    """The fastest weight mode here for ``config``'s shapes, and why, in a few words ("int4:
    fastest here (products tok/s: int4 167, int8 125, fp32 50)"). Measured once per machine and
    model shape, then read.
    ``four_bit``: the checkpoint is stored in 4 bits (int4 is then within its quality bar)."""
    modes = candidates(compiled, four_bit) if fit_the_kernel(config) else ["none"]
    if modes == ["none"]:
        return "none", "no faster mode runs here"
    if "int8" in modes:
        from kvchat.engine.model.kernel_build import build_kernel, kernel_built_before

        if not kernel_built_before():
            # a first start that `kvchat prepare` did not precede: a reply must not wait for the
            # kernel's first build, so the rule answers now (int8, whose layers run inductor's
            # products until the kernel, built in the background, takes over) and the next start times
            return "int8", "int8: this machine is timed once the int8 kernel is built (next start)"
        build_kernel()  # from the disk cache
        if not int8_rows.built:
            modes = ["none"]
    key = _key(config, modes)
    try:
        known = json.loads(_store().read_text())
    except (OSError, ValueError):
        known = {}
    times = known.get(key) if isinstance(known, dict) else None
    if not (isinstance(times, dict) and set(times) == set(modes)):
        started = time.perf_counter()
        times = {mode: time_token(mode, config) for mode in modes}
        log.info("weight modes timed in %.1f s: %s", time.perf_counter() - started,
                 ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in times.items()))
        known = known if isinstance(known, dict) else {}
        known[key] = times
        try:
            _store().parent.mkdir(parents=True, exist_ok=True)
            tmp = _store().with_suffix(".tmp")
            tmp.write_text(json.dumps(known))
            os.replace(tmp, _store())
        except OSError as e:  # measured again next time: nothing is lost
            log.warning("weight speeds not saved (%s)", e)
    own = times["none"]
    best = min(times, key=times.get)
    said = "fastest here"
    # products timed alone miss the K/V and the head that a step streams through the same memory:
    # under AVX-VNNI int8's products timed 3 % ahead of int4's, and int4 (0.63 of its bytes)
    # decoded the starter 5-10 % faster
    if best == "int8" and "int4" in times and times["int4"] < times["int8"] * SAME and times["int4"] * MARGIN <= own:
        best, said = "int4", "as fast as int8 in fewer bytes"
    if best != "none" and times[best] * MARGIN > own:
        best, said = "none", "fastest here"
    rates = sorted(times.items(), key=lambda item: item[1])
    why = ", ".join(f"{LABELS[m]} {1 / t:.0f}" for m, t in rates)
    return best, f"{LABELS[best]}: {said} (products tok/s: {why})"
