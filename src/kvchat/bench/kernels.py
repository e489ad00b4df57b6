"""``kvchat bench kernels``: the paged decode kernel's bytes-and-occupancy model for an 8B-shaped
layer (32 heads, 8 KV heads, head_dim 128) at 2k, 8k and 32k tokens, per KV precision, with the
time the model predicts on an H200 and an RTX 4090; on CUDA also Triton against the reference and
the kernel's measured time, from a captured CUDA graph of the call the engine makes (with the
window in the quantized modes), beside the prediction. ``--compile``: every kernel variant the
engine runs, compiled for sm_86/89/90 without a GPU (registers, spills, shared memory, seconds).

The model. A decode call reads every K/V byte of the context once, so at best it takes
bytes / bandwidth. It gets there only if enough bytes are in flight: by Little's law an SM must
keep bandwidth-per-SM x memory latency bytes requested and not yet arrived. The kernel's
pipeline keeps ``ahead`` tiles of K/V requested per program (the cp.async buffers that
``tl.range`` allocates: 1 at 3-4 stages, 2 at 5), and an SM holds as many programs as its
registers and shared memory allow (the compile table), or as many as it is given. Predicted
time = fixed launch cost + bytes / min(bandwidth, SMs x bytes in flight per SM / latency), over
as many waves as the programs need. The latencies are assumptions (loaded-DRAM latency, a few
hundred ns over the idle one), written in DEVICES; the GPU run checks them.
"""
import json
import math
import os
import sys

import torch

from kvchat.kernels import int4, quant
from kvchat.kernels import reference
from kvchat.engine.kv.recent_window import RecentWindow

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)
CONTEXTS = (2048, 8192, 32768)
PRECISIONS = tuple(quant.FORMATS)  # fp16, int8, fp8, k8v4, int4
BS = 16
# bandwidth (bytes/s), SMs, shared memory an SM gives its programs, loaded memory latency (s),
# fixed cost of the two launches in a captured graph (s)
DEVICES = {
    "H200": dict(bandwidth=4.8e12, sms=132, capability=90, latency=0.9e-6, fixed=4e-6),
    "RTX 4090": dict(bandwidth=1.008e12, sms=128, capability=89, latency=0.7e-6, fixed=4e-6),
}


def build(fmt, length, heads, kv_heads, head_dim, device, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = -(-length // BS)
    pool = quant.layer_tensors(fmt, blocks + 8, BS, kv_heads, head_dim, dtype, device)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(device)
    rot = quant.hadamard(head_dim, device)
    slots = (table[torch.arange(length, device=device) // BS] * BS + torch.arange(length, device=device) % BS)
    k = torch.randn(length, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(length, kv_heads, head_dim, generator=g).to(device, dtype)
    reference.write_kv(pool, fmt, k, v, slots, rot)
    q = torch.randn(1, heads, head_dim, generator=g).to(device, dtype)
    return pool, table, rot, q, (k, v, slots)


def check(device, dtype=torch.bfloat16, length: int = 1000) -> list[dict]:
    """Writes: the share of stored bytes that differ from the reference's (on a GPU the rotation's
    sums run in another order than torch's, so a value on a rounding edge may land one step away),
    and the largest difference of a dequantized value, in quantization steps. Decode: max |error|."""
    from kvchat.kernels import triton_kv
    from kvchat.kernels import triton_decode

    rows = []
    for name in PRECISIONS:
        fmt = quant.FORMATS[name]
        pool, table, rot, q, (k, v, slots) = build(fmt, length, 8, 2, 128, device, dtype=dtype)
        row = {"precision": name}
        if fmt.quantized:
            other = quant.layer_tensors(fmt, pool["k"].shape[0], BS, 2, 128, dtype, device)
            triton_kv.quantize_write(other, fmt, k, v, slots, rot)
            row["write_bytes_differing"] = sum((pool[n] != other[n]).sum().item() for n in pool) / sum(
                pool[n].numel() for n in pool)
            row["write_max_steps"] = max(_steps_apart(pool, other, fmt, n, table, length) for n in ("k", "v"))
        want = reference.paged_attention(q.float(), {n: t.float() if t.dtype == dtype else t for n, t in pool.items()},
                                         fmt, table, length, 128 ** -0.5, None, rot)
        got = triton_decode.paged_decode(q, pool, fmt, table[None].int(), torch.tensor([length], device=device,
                                     dtype=torch.int32), 128 ** -0.5, rot).float()
        row["decode_max_abs_err"] = (got - want).abs().max().item()
        rows.append(row)
    return rows


def _steps_apart(a, b, fmt, name, table, length: int) -> float:
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    if bits == 16:
        return 0.0
    if fmt.float8:
        return float((quant.fp8_order(a[name]) - quant.fp8_order(b[name])).abs().max().item())
    x = quant.read(a, fmt, name, table, length, None, torch.float32)
    y = quant.read(b, fmt, name, table, length, None, torch.float32)
    if name == "k" and fmt.block_keys:  # a step per block and channel
        step = int4.step_of(quant.gather_blocks(a["k_scale"], table, None)).repeat_interleave(a["k"].shape[1], 0)
        step = step[:length]
    else:
        step = quant.gather(a[name + "_scale"], table, length, None).float().repeat_interleave(quant.GROUP, -1)
    return ((x - y).abs() / step).max().item()


def tiles_ahead(stages: int) -> int:
    """K/V tiles a program keeps requested: what Triton 3.9's pipeliner gives an indirect load
    (the block ids are loaded a stage before the rows they name), read off the compiled kernels."""
    return max(1, stages - 3)


def model(precision: str, context: int, device: dict, compiled: dict | None = None, heads: int = 32,
          kv_heads: int = 8, head_dim: int = 128) -> dict:
    """The bytes-and-occupancy model of one decode call (one sequence, with the window in the
    quantized modes). ``compiled``: ``{"registers", "shared"}`` of the variant on this device's
    target (``kernels.compile_check``), else the design budget is assumed."""
    from kvchat.kernels import compile_check
    from kvchat.kernels import triton_decode

    fmt = quant.FORMATS[precision]
    tile, stages = triton_decode.decode_config(fmt, head_dim)
    window = fmt.quantized
    per_token = quant.token_bytes(fmt, kv_heads, head_dim)  # K and V, scales included
    pool_tokens = max(0, context - (quant.WINDOW + quant.SINKS if window else 0))
    window_bytes = 2 * (quant.WINDOW + quant.SINKS) * kv_heads * head_dim * 2 if window else 0
    read = pool_tokens * per_token + window_bytes + context // BS * 4  # + the block ids
    splits = triton_decode.decode_splits(device["sms"], 1, kv_heads, context, tile)
    tiles = -(-pool_tokens // tile)
    per_program = -(-tiles // splits)
    programs = kv_heads * splits
    threads = 32 * triton_decode.DECODE_WARPS
    regs = (compiled or {}).get("registers") or compile_check.REGISTER_BUDGET
    shared = (compiled or {}).get("shared") or 0
    cap = device["capability"]
    fit = min(65536 // (math.ceil(regs / 8) * 8 * threads), compile_check.SHARED_PER_SM[cap] // shared if shared else 32,
              compile_check.THREADS_PER_SM[cap] // threads)
    given = -(-programs // device["sms"])
    resident = max(1, min(fit, given))
    waves = -(-given // resident)
    tile_bytes = tile * per_token / kv_heads  # a program reads one KV head
    in_flight = resident * tiles_ahead(stages) * tile_bytes
    busy_sms = min(device["sms"], programs)
    reach = min(device["bandwidth"], busy_sms * in_flight / device["latency"])
    # every program waits out at least one latency per wave before its first tile lands
    seconds = device["fixed"] + waves * device["latency"] + read / reach
    return {"precision": precision, "context": context, "bytes": read, "splits": splits, "programs": programs,
            "iterations_per_program": per_program, "programs_per_sm_fit": fit, "programs_per_sm": resident,
            "bytes_in_flight_per_sm": in_flight, "bandwidth_reached": reach, "predicted_us": seconds * 1e6,
            "bound_us": read / device["bandwidth"] * 1e6}


def measure(device, precision: str, context: int) -> float:
    """Microseconds per call from a captured CUDA graph of the call a decode step makes (the
    window in the quantized modes), so launch cost and the Python wrapper are not in it."""
    import triton.testing

    from kvchat.kernels import triton_decode

    fmt = quant.FORMATS[precision]
    pool, table, rot, q, _ = build(fmt, context, device=device, **SHAPE)
    lens = torch.tensor([context], device=device, dtype=torch.int32)
    window = None
    if fmt.quantized:
        recent = RecentWindow(1, SHAPE["kv_heads"], SHAPE["head_dim"], torch.bfloat16, device)
        rows = torch.randn(context, SHAPE["kv_heads"], SHAPE["head_dim"], device=device)
        recent.store(0, 0, rows, rows)
        s, first = recent.bounds(0, context)
        wmeta = torch.tensor([s, first, recent.ring_row(context - 1)], dtype=torch.int32, device=device)
        window = (recent.k[0], recent.v[0], recent.sinks, wmeta)
    table = table[None].int()
    call = lambda: triton_decode.paged_decode(q, pool, fmt, table, lens, 128 ** -0.5, rot, window=window)
    call()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(call, rep=50) * 1000


def decode_resources(targets=(89, 90)) -> list[dict]:
    """Registers and shared memory of the decode variants the model needs (8B shape, the window in
    the quantized modes), compiled here for ``targets``: a few seconds. Under the interpreter
    nothing can be compiled in this process, and the model assumes the design budget."""
    from kvchat.kernels import compile_check

    if os.environ.get("TRITON_INTERPRET") == "1":
        return []
    label, heads, kv_heads, head_dim = compile_check.SHAPES[0]
    wanted = {_variant_name(p) for p in PRECISIONS}
    return [{"shape": label, **compile_check.compile_variant(v, cap)}
            for v in compile_check.decode_variants(heads, kv_heads, head_dim) if v.name in wanted for cap in targets]


def _variant_name(precision: str) -> str:
    return f"decode {precision}" + (" +window" if quant.FORMATS[precision].quantized else "")


def predictions(compiled_rows: list | None = None, measure_on=None) -> list[dict]:
    """The model for every precision and context, on every device in DEVICES (and on the device
    at hand, with its measured time, when ``measure_on`` is a CUDA device)."""
    devices = dict(DEVICES)
    if measure_on is not None:
        props = torch.cuda.get_device_properties(measure_on)
        name = torch.cuda.get_device_name(measure_on)
        like = next((d for n, d in DEVICES.items() if n.split()[-1] in name), DEVICES["H200"])
        devices = {f"{name} (here)": {**like, "sms": props.multi_processor_count,
                                      "capability": props.major * 10 + props.minor}}
    rows = []
    for dev_name, dev in devices.items():
        for context in CONTEXTS:
            for precision in PRECISIONS:
                compiled = _compiled_for(compiled_rows, precision, dev["capability"])
                row = {"device": dev_name, **model(precision, context, dev, compiled)}
                if measure_on is not None:
                    row["measured_us"] = measure(measure_on, precision, context)
                rows.append(row)
    return rows


def _compiled_for(rows, precision: str, capability: int) -> dict | None:
    name = _variant_name(precision)
    target = f"sm_{min(capability, 90)}"
    return next((r for r in rows or () if r["variant"] == name and r["target"] == target
                 and r["shape"] == "llama-8b"), None)


def compile_table(full: bool = True) -> list[dict]:
    """``kernels.compile_check.table`` in a fresh process when this one runs the interpreter."""
    from kvchat.kernels import compile_check

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("kvchat bench kernels --compile: unset TRITON_INTERPRET (it compiles for a GPU)")
    shapes = compile_check.SHAPES if full else compile_check.SHAPES[:1]
    return compile_check.table(shapes)


def main(as_json: bool, compile_kernels: bool = False) -> None:
    result = {}
    if compile_kernels:
        from kvchat.kernels import compile_check

        result["triton"] = compile_check.judged()
        result["compile"] = compile_table()
    cuda = torch.device("cuda") if torch.cuda.is_available() else None
    if cuda is not None:
        result["device"] = torch.cuda.get_device_name()
        result["check"] = check(cuda)
    else:
        print("kvchat bench kernels: no CUDA device here: the model's predictions only (the kernels are "
              "checked on the CPU by the test suite, TRITON_INTERPRET=1)", file=sys.stderr)
    resources = result.get("compile") or decode_resources()
    result["model"] = predictions(resources)
    if cuda is not None:
        result["measured"] = predictions(resources, measure_on=cuda)
    if as_json:
        print(json.dumps(result, indent=2))
        return
    report(result)


def report(result: dict) -> None:
    if "compile" in result:
        t = result["triton"]
        print(f"Triton {t['version']} (budgets tuned on {t['tuned_on']}: {t['budgets']})")
        print("compiled without a GPU (triton.compile + GPUTarget), registers / spill bytes / shared bytes / s:")
        for r in result["compile"]:
            print(f"  {r['shape']:<11} {r['variant']:<20} {r['target']}  regs {r['registers']:>3}  "
                  f"spill {r['spill_bytes']:>4}  shared {r['shared']:>6}  {r['programs_per_sm']} prog/SM  "
                  f"{r['seconds']:.1f} s")
    if "device" in result:
        print(f"device: {result['device']}")
        for r in result["check"]:
            write = (f"write: {r['write_bytes_differing']:.2e} of bytes differ, at most {r['write_max_steps']:.0f} "
                     f"step(s) apart; " if "write_bytes_differing" in r else "")
            print(f"  {r['precision']:<5} {write}decode max |err| {r['decode_max_abs_err']:.2e}")
    print("paged decode, 32 heads / 8 KV heads / head_dim 128, one sequence (window in the quantized modes):")
    print(f"  {'device':<22} {'ctx':>6} {'prec':<5} {'MB':>6} {'splits':>6} {'iter':>4} {'prog/SM':>7} "
          f"{'KB in flight/SM':>15} {'bound us':>8} {'model us':>8} {'measured':>8}")
    for r in result.get("measured", []) + result["model"]:
        measured = f"{r['measured_us']:8.1f}" if "measured_us" in r else f"{'':>8}"
        print(f"  {r['device']:<22} {r['context']:>6} {r['precision']:<5} {r['bytes'] / 1e6:6.1f} {r['splits']:>6} "
              f"{r['iterations_per_program']:>4} {r['programs_per_sm']:>3}/{r['programs_per_sm_fit']:<3} "
              f"{r['bytes_in_flight_per_sm'] / 1024:15.0f} {r['bound_us']:8.1f} {r['predicted_us']:8.1f} {measured}")
