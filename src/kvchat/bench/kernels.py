"""``kvchat bench kernels``: on CUDA, Triton against the reference, then paged decode attention on a
7B-shaped layer (32 heads, 8 KV heads, head_dim 128) at 2k, 8k and 32k tokens, with the bytes each
call must read and the GB/s achieved."""
import json
import sys

import torch

from kvchat.kernels import quant
from kvchat.kernels import reference

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)
CONTEXTS = (2048, 8192, 32768)
BS = 16


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

    rows = []
    for name in ("fp16", "int8", "k8v4", "int4"):
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
        got = triton_kv.paged_decode(q, pool, fmt, table[None].int(), torch.tensor([length], device=device,
                                     dtype=torch.int32), 128 ** -0.5, rot).float()
        row["decode_max_abs_err"] = (got - want).abs().max().item()
        rows.append(row)
    return rows


def _steps_apart(a, b, fmt, name, table, length: int) -> float:
    bits = fmt.k_bits if name == "k" else fmt.v_bits
    if bits == 16:
        return 0.0
    x = quant.read(a, fmt, name, table, length, None, torch.float32)
    y = quant.read(b, fmt, name, table, length, None, torch.float32)
    step = quant.gather(a[name + "_scale"], table, length, None).float().repeat_interleave(quant.GROUP, -1)
    return ((x - y).abs() / step).max().item()


def time_decode(device) -> list[dict]:
    from kvchat.kernels import triton_kv

    rows = []
    for length in CONTEXTS:
        for name in ("fp16", "int8", "int4"):
            fmt = quant.FORMATS[name]
            pool, table, rot, q, _ = build(fmt, length, device=device, **SHAPE)
            lens = torch.tensor([length], device=device, dtype=torch.int32)
            call = lambda: triton_kv.paged_decode(q, pool, fmt, table[None].int(), lens, 128 ** -0.5, rot)
            for _ in range(3):
                call()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                call()
            end.record()
            torch.cuda.synchronize()
            us = start.elapsed_time(end) / 20 * 1000
            moved = length * quant.token_bytes(fmt, SHAPE["kv_heads"], SHAPE["head_dim"])
            rows.append({"context": length, "precision": name, "us": us, "bytes": moved, "gb_s": moved / us / 1e3})
        base = next(r["us"] for r in rows if r["context"] == length and r["precision"] == "fp16")
        for r in rows:
            if r["context"] == length:
                r["speedup_vs_fp16"] = base / r["us"]
    return rows


def main(as_json: bool) -> None:
    if not torch.cuda.is_available():
        print("kvchat bench kernels: no CUDA device here; the Triton kernels are checked on the CPU by the "
              "test suite (TRITON_INTERPRET=1)", file=sys.stderr)
        sys.exit(1)
    device = torch.device("cuda")
    result = {"device": torch.cuda.get_device_name(), "check": check(device), "decode": time_decode(device)}
    if as_json:
        print(json.dumps(result, indent=2))
        return
    print(f"device: {result['device']}")
    for r in result["check"]:
        write = (f"write: {r['write_bytes_differing']:.2e} of bytes differ, at most {r['write_max_steps']:.0f} "
                 f"step(s) apart; " if "write_bytes_differing" in r else "")
        print(f"  {r['precision']:<5} {write}decode max |err| {r['decode_max_abs_err']:.2e}")
    print("paged decode, 32 heads / 8 KV heads / head_dim 128, one sequence:")
    for r in result["decode"]:
        print(f"  {r['context']:>6} tokens {r['precision']:<5} {r['us']:8.1f} us  {r['bytes'] / 1e6:7.1f} MB  "
              f"{r['gb_s']:7.1f} GB/s  x{r['speedup_vs_fp16']:.2f} vs fp16")
