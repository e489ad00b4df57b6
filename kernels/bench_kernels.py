"""``kvchat bench kernels``: on CUDA, Triton against the reference, then paged decode attention on a
7B-shaped layer (32 heads, 8 KV heads, head_dim 128) at 2k, 8k and 32k tokens, with the bytes each
call must read and the GB/s achieved."""
import json
import sys

import torch

from . import quant, reference

SHAPE = dict(heads=32, kv_heads=8, head_dim=128)
CONTEXTS = (2048, 8192, 32768)
BS = 16


def kv_bytes(fmt, length: int, kv_heads: int, head_dim: int, full_bytes: int = 2) -> float:
    per_element = quant.element_bytes(fmt.k_bits, full_bytes) + quant.element_bytes(fmt.v_bits, full_bytes)
    return length * kv_heads * head_dim * per_element


def build(fmt, length, heads, kv_heads, head_dim, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = -(-length // BS)
    pool = quant.layer_tensors(fmt, blocks + 8, BS, kv_heads, head_dim, torch.bfloat16, device)
    table = torch.randperm(blocks + 8, generator=g)[:blocks].to(device)
    rot = quant.hadamard(head_dim, device)
    slots = (table[torch.arange(length, device=device) // BS] * BS + torch.arange(length, device=device) % BS)
    k = torch.randn(length, kv_heads, head_dim, generator=g).to(device, torch.bfloat16)
    v = torch.randn(length, kv_heads, head_dim, generator=g).to(device, torch.bfloat16)
    reference.write_kv(pool, fmt, k, v, slots, rot)
    q = torch.randn(1, heads, head_dim, generator=g).to(device, torch.bfloat16)
    return pool, table, rot, q, (k, v, slots)


def check(device) -> list[dict]:
    from . import triton_kv

    rows = []
    for name in ("fp16", "int8", "k8v4", "int4"):
        fmt = quant.FORMATS[name]
        pool, table, rot, q, (k, v, slots) = build(fmt, 1000, 8, 2, 128, device)
        other = quant.layer_tensors(fmt, pool["k"].shape[0], BS, 2, 128, torch.bfloat16, device)
        if fmt.quantized:
            triton_kv.quantize_write(other, fmt, k, v, slots, rot)
        write_exact = all(torch.equal(pool[n], other[n]) for n in pool) if fmt.quantized else True
        want = reference.paged_attention(q.float(), {n: t if t.dtype != torch.bfloat16 else t.float()
                                                     for n, t in pool.items()}, fmt, table, 1000, 128 ** -0.5,
                                         None, rot)
        got = triton_kv.paged_decode(q, pool, fmt, table[None].int(), torch.tensor([1000], device=device,
                                     dtype=torch.int32), 128 ** -0.5, rot).float()
        rows.append({"precision": name, "write_byte_exact": write_exact,
                     "decode_max_abs_err": (got - want).abs().max().item()})
    return rows


def time_decode(device) -> list[dict]:
    from . import triton_kv

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
            moved = kv_bytes(fmt, length, SHAPE["kv_heads"], SHAPE["head_dim"])
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
        print(f"  {r['precision']:<5} write byte-exact {r['write_byte_exact']}, decode max |err| "
              f"{r['decode_max_abs_err']:.2e}")
    print("paged decode, 32 heads / 8 KV heads / head_dim 128, one sequence:")
    for r in result["decode"]:
        print(f"  {r['context']:>6} tokens {r['precision']:<5} {r['us']:8.1f} us  {r['bytes'] / 1e6:7.1f} MB  "
              f"{r['gb_s']:7.1f} GB/s  x{r['speedup_vs_fp16']:.2f} vs fp16")
