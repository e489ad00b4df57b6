"""The paged decode kernel (one query token per sequence against its blocks, every precision) and
the merge of its splits. Twin of ``reference.paged_attention`` at T=1; the layout is quant.py's,
and the pool's shape checks and the write kernel are triton_kv.py's.

Each head_dim vector is handled as two halves of D/2, the split-half int4 layout's natural unit:
byte j of a packed row holds dim j and dim j + D/2, so one load serves both halves.
"""
import torch
import triton
import triton.language as tl

from kvchat.kernels import int4, quant
from kvchat.kernels.quant import KVFormat
from kvchat.kernels.reference import PLAIN, Band
from kvchat.kernels.triton_kv import check_pool, fp8_mode, load_fp8

# The paged decode kernel. Designed to be bound by memory bandwidth in every precision; the numbers
# behind each choice are in ``kvchat bench kernels`` (a bytes-and-occupancy model) and in the
# compile table of ``kvchat bench kernels --compile``.
# - TILE tokens (4 blocks of 16) per loop iteration: the old kernel's 16-token iterations each
#   waited out a full memory latency, so its time followed the iteration count, not the bytes.
# - The block ids of a tile are one vector load and every row is masked, never skipped by a
#   data-dependent ``if``: the loop body is straight-line code that ``tl.range`` can pipeline
#   (STAGES loads in flight, cp.async on sm_80+).
# - The GQA group's queries are the M side of a tensor-core product, padded to QG_MIN rows (the
#   smallest M of an mma); K and V are read once per KV head, whatever the group.
# - Quantized K/V never meet a dequantized [rows, D] tile: codes are exact in fp16, so the products
#   take the codes as they are and the fp16 scales, loaded as [rows, D/32] tiles, scale the
#   per-group partial scores (K) and the probabilities (V) instead. Each head_dim is cut into
#   chunks of CH (= one scale group) along a leading batch axis, so a group's scale is a broadcast.
# - Splits: a fixed count from the SM count (``decode_splits``); each program computes its own
#   share of the tiles from the length it reads, so a captured graph padded to a large bucket
#   runs as many programs as an exact one, and an empty share costs one load.
# - The window's rows (sinks + ring) are read BS at a time by one more program per KV head.
DECODE_TILE = 64
# fp8 reads tiles of 32: at 64, with no scale tiles, Triton 3.9 held its codes in 134-146 registers
# (sm_86-90, 3 programs an SM); at 32, 96-102 (5), for half the bytes a tile, the same in flight an SM
# int4's keys read a block's statistics as one [D] vector a tile, so its tiles are one block each:
# the rows' own statistics gathered as [D/2, rows] tiles took 138-151 registers at 64 rows and at
# 32 spilled on sm_90 (8B and Gemma 2 shapes)
DECODE_TILES = {"fp8": 32, "int4": 16}
# int4 at 2 stages spilled 8 B on sm_86/89 (Gemma 2's shape, the window and the band); at 3, none
DECODE_STAGES = {"fp16": 3, "int8": 3, "fp8": 3, "k8v4": 3, "int4": 3}
DECODE_WARPS = 4
QG_MIN = 16
PROGRAMS_PER_SM = 4  # the occupancy the register budget is designed for (tests/kernels/test_compile.py)


@triton.jit
def _scales(scale_ptr, row, valid, UPPER: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
            ROWS_FIRST: tl.constexpr):
    """A half's fp16 scales, one per element of the tile: ``[T, HALF]`` (ROWS_FIRST) or
    ``[HALF, T]``. A row's scales are read as one integer word (both halves' 2 at head_dim 64, a
    half's 2 or 4 at 128 or 256) and cut into groups by shifts: 4-8 contiguous bytes make one
    asynchronous copy that the loop's pipeline prefetches with the codes, where fp16 elements
    one by one are 2-byte loads it cannot, and each tile would wait out their latency."""
    if NCH == 1:
        word = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + row, mask=valid, other=0)
    elif NCH == 2:
        word = tl.load(scale_ptr.to(tl.pointer_type(tl.int32)) + row * 2 + UPPER, mask=valid, other=0)
    else:
        word = tl.load(scale_ptr.to(tl.pointer_type(tl.int64)) + row * 2 + UPPER, mask=valid, other=0)
    shift = 16 * (tl.arange(0, NCH * CH) // CH + (UPPER if NCH == 1 else 0))
    if ROWS_FIRST:
        bits = (word[:, None] >> shift[None, :]) & 0xFFFF
    else:
        bits = (word[None, :] >> shift[:, None]) & 0xFFFF
    return bits.to(tl.uint16).to(tl.float16, bitcast=True)


@triton.jit
def _half_codes(ptr, offsets, live, D: tl.constexpr, BITS: tl.constexpr, DIM_STEP):
    """Both halves' signed codes of a tile as int32. int8: two loads, ``DIM_STEP`` (D/2 dims
    apart); int4: one load of the packed bytes (split-half: byte j holds dims j and j + D/2), so
    each byte crosses the memory bus once."""
    if BITS == 8:
        lo = tl.load(ptr + offsets, mask=live, other=0).to(tl.int32)
        hi = tl.load(ptr + offsets + DIM_STEP, mask=live, other=0).to(tl.int32)
    else:
        packed = tl.load(ptr + offsets, mask=live, other=0x88).to(tl.int32)
        lo = (packed & 15) - 8
        hi = (packed >> 4) - 8
    return lo, hi


@triton.jit
def _k_tile(k_ptr, ks_ptr, kz_ptr, steps_ptr, row, valid, D: tl.constexpr, BITS: tl.constexpr, NCH: tl.constexpr,
            CH: tl.constexpr, DOT: tl.constexpr, FP8: tl.constexpr, BLOCK_KEYS: tl.constexpr,
            BS_HEADS: tl.constexpr, KV_HEADS: tl.constexpr):
    """The tile's keys, transposed for the product, as two halves ``[D/2, T]`` in DOT: dequantized
    where the product's operand lies (codes are exact in fp16, then times their scale; fp8 codes
    are values, exact in fp16 too). BLOCK_KEYS (int4): the tile is one block (``decode_config``),
    whose statistics are step codes in ``ks_ptr`` (steps in the table ``steps_ptr``) and minimums
    in ``kz_ptr``, a row per block and KV head (``BS_HEADS`` pool rows a block)."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)[:, None]
    r = row[None, :]
    live = valid[None, :]
    if BLOCK_KEYS:
        packed = tl.load(k_ptr + r * HALF + d, mask=live, other=0).to(tl.int32)
        stats = tl.max(tl.where(valid, (row // BS_HEADS) * KV_HEADS + row % KV_HEADS, 0), axis=0)
        col = stats * D + d
        # in DOT, as the other int modes' codes times their scales: fp32 took Gemma 2's shape past its budget
        step_lo = tl.load(steps_ptr + tl.load(ks_ptr + col).to(tl.int32)).to(DOT)  # [D/2, 1]: the block's
        step_hi = tl.load(steps_ptr + tl.load(ks_ptr + col + HALF).to(tl.int32)).to(DOT)
        lo = (packed & 15).to(DOT) * step_lo + tl.load(kz_ptr + col).to(DOT)
        hi = (packed >> 4).to(DOT) * step_hi + tl.load(kz_ptr + col + HALF).to(DOT)
    elif BITS == 16:
        lo = tl.load(k_ptr + r * D + d, mask=live, other=0.0).to(DOT)
        hi = tl.load(k_ptr + r * D + HALF + d, mask=live, other=0.0).to(DOT)
    elif FP8:
        lo = load_fp8(k_ptr, r * D + d, live, FP8).to(DOT)
        hi = load_fp8(k_ptr, r * D + HALF + d, live, FP8).to(DOT)
    else:
        width: tl.constexpr = D if BITS == 8 else HALF
        c_lo, c_hi = _half_codes(k_ptr, r * width + d, live, D, BITS, HALF)
        lo = c_lo.to(DOT) * _scales(ks_ptr, row, valid, 0, NCH, CH, False).to(DOT)
        hi = c_hi.to(DOT) * _scales(ks_ptr, row, valid, 1, NCH, CH, False).to(DOT)
    return lo, hi


@triton.jit
def _v_tile(v_ptr, vs_ptr, row, valid, D: tl.constexpr, BITS: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
            DOT: tl.constexpr, FP8: tl.constexpr):
    """The tile's values as two halves ``[T, D/2]`` in DOT."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)[None, :]
    r = row[:, None]
    live = valid[:, None]
    if BITS == 16:
        lo = tl.load(v_ptr + r * D + d, mask=live, other=0.0).to(DOT)
        hi = tl.load(v_ptr + r * D + HALF + d, mask=live, other=0.0).to(DOT)
    elif FP8:
        lo = load_fp8(v_ptr, r * D + d, live, FP8).to(DOT)
        hi = load_fp8(v_ptr, r * D + HALF + d, live, FP8).to(DOT)
    else:
        width: tl.constexpr = D if BITS == 8 else HALF
        c_lo, c_hi = _half_codes(v_ptr, r * width + d, live, D, BITS, HALF)
        lo = c_lo.to(DOT) * _scales(vs_ptr, row, valid, 0, NCH, CH, True).to(DOT)
        hi = c_hi.to(DOT) * _scales(vs_ptr, row, valid, 1, NCH, CH, True).to(DOT)
    return lo, hi


@triton.jit
def _attend_tile(q_lo, q_hi, acc_lo, acc_hi, m, l, k_ptr, ks_ptr, kz_ptr, steps_ptr, v_ptr, vs_ptr, row, valid,
                 qk_scale, D: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, NCH: tl.constexpr,
                 CH: tl.constexpr, DOT: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr, CAP: tl.constexpr,
                 BLOCK_KEYS: tl.constexpr, BS_HEADS: tl.constexpr, KV_HEADS: tl.constexpr):
    """Online softmax (base 2) of the query group ``[QG_PAD, D/2]`` x 2 over the tile's rows
    ``row`` ``[T]`` (``valid`` masks the rest): the running ``acc`` halves, max ``m`` and sum ``l``.
    ``CAP``, the soft cap in base-2 units (0: none), bounds the scores to ``CAP * tanh(s / CAP)``."""
    k_lo, k_hi = _k_tile(k_ptr, ks_ptr, kz_ptr, steps_ptr, row, valid, D, K_BITS, NCH, CH, DOT, FP8, BLOCK_KEYS,
                         BS_HEADS, KV_HEADS)
    s = tl.dot(q_lo, k_lo, input_precision=PREC)
    s = tl.dot(q_hi, k_hi, s, input_precision=PREC) * qk_scale
    if CAP > 0:  # tanh(y) = 1 - 2 / (2^(2y log2 e) + 1), y = s / CAP: exp2 as the softmax's
        s = CAP * (1.0 - 2.0 / (tl.exp2(s * (2.0 * 1.4426950408889634 / CAP)) + 1.0))
    s = tl.where(valid[None, :], s, -float("inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # no valid row yet: nothing to scale
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    p = p.to(DOT)
    v_lo, v_hi = _v_tile(v_ptr, vs_ptr, row, valid, D, V_BITS, NCH, CH, DOT, FP8)
    acc_lo = tl.dot(p, v_lo, acc_lo * alpha[:, None], input_precision=PREC)
    acc_hi = tl.dot(p, v_hi, acc_hi * alpha[:, None], input_precision=PREC)
    return acc_lo, acc_hi, m_new, l



# What changes with the context length is a runtime argument, never specialized on: a new value
# would compile the kernel again mid-reply. ``splits`` is fixed per device (and per eager length).
@triton.jit(do_not_specialize=["table_stride", "splits"])
def _paged_decode_kernel(q_ptr, k_ptr, ks_ptr, kz_ptr, steps_ptr, v_ptr, vs_ptr, table_ptr, len_ptr, acc_ptr, m_ptr,
                         l_ptr, wk_ptr, wv_ptr, wmeta_ptr, qk_scale, table_stride, splits,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         K_BITS: tl.constexpr, V_BITS: tl.constexpr, CH: tl.constexpr, QG: tl.constexpr,
                         QG_PAD: tl.constexpr, TILE: tl.constexpr, STAGES: tl.constexpr, DOT: tl.constexpr,
                         W_DOT: tl.constexpr, PREC: tl.constexpr, WINDOW: tl.constexpr, W_SINKS: tl.constexpr,
                         W_SIZE: tl.constexpr, FP8: tl.constexpr, SLIDE: tl.constexpr, CAP: tl.constexpr,
                         BLOCK_KEYS: tl.constexpr):
    """One program per (sequence, KV head, split); with WINDOW (one sequence) one more per KV head
    (split ``splits``) attends to the window's rows: sinks ``0 .. s``, then the ring's positions
    ``first .. length``, with ``s`` and ``first`` read from ``wmeta`` (a tensor a captured step
    updates); the pool then serves positions ``s .. first`` only. ``SLIDE``, a layer's sliding
    window (0: none), hides positions before ``length - SLIDE``: the pool's tiles start at the
    window's first, so a windowed layer reads only its window. Partial results go to
    ``acc``/``m``/``l`` ``[B, HEADS, splits + WINDOW]``; ``_merge_kernel`` combines them."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    HALF: tl.constexpr = D // 2
    NCH: tl.constexpr = HALF // CH
    length = tl.load(len_ptr + b)
    qa = tl.arange(0, QG_PAD)
    real = qa < QG
    j = tl.arange(0, HALF)
    q_off = (b * HEADS + kvh * QG + qa)[:, None] * D + j[None, :]
    q_lo = tl.load(q_ptr + q_off, mask=real[:, None], other=0.0)  # [QG_PAD, D/2], fp32
    q_hi = tl.load(q_ptr + q_off + HALF, mask=real[:, None], other=0.0)
    m = tl.full([QG_PAD], -float("inf"), dtype=tl.float32)
    l = tl.zeros([QG_PAD], dtype=tl.float32)
    acc_lo = tl.zeros([QG_PAD, HALF], dtype=tl.float32)
    acc_hi = tl.zeros([QG_PAD, HALF], dtype=tl.float32)
    seen = 0  # the first position the new token sees
    if SLIDE:
        seen = tl.maximum(length - SLIDE, 0)
    w_s = 0
    w_first = 0
    if WINDOW:
        w_s = tl.load(wmeta_ptr)
        w_first = tl.load(wmeta_ptr + 1)
    if WINDOW and split == splits:
        wq_lo = q_lo.to(W_DOT)
        wq_hi = q_hi.to(W_DOT)
        W_ROWS: tl.constexpr = W_SINKS + W_SIZE
        for c in range(0, W_ROWS, BS):  # a block's worth of rows at a time: all at once spilled
            r = c + tl.arange(0, BS)
            pos = (length - 1) - ((length - 1 - (r - W_SINKS)) % W_SIZE)  # the newest position a ring row holds
            valid = tl.where(r < W_SINKS, (r < w_s) & (r >= seen),
                             (r < W_ROWS) & (pos >= w_first) & (pos >= seen) & (pos < length))
            acc_lo, acc_hi, m, l = _attend_tile(wq_lo, wq_hi, acc_lo, acc_hi, m, l, wk_ptr, wk_ptr, wk_ptr, wk_ptr,
                                                wv_ptr, wv_ptr, r * KV_HEADS + kvh, valid, qk_scale, D, 16, 16, NCH,
                                                CH, W_DOT, PREC, 0, CAP, False, BS * KV_HEADS, KV_HEADS)
    else:
        kv_start = seen
        end = length
        if WINDOW:
            kv_start = tl.maximum(w_s, seen)
            end = tl.minimum(length, w_first)
        first_tile = kv_start // TILE
        tiles = tl.maximum(tl.cdiv(end, TILE) - first_tile, 0)
        per_split = tl.cdiv(tiles, splits)
        lo = first_tile + split * per_split
        hi = tl.minimum(lo + per_split, first_tile + tiles)
        dq_lo = q_lo.to(DOT)
        dq_hi = q_hi.to(DOT)
        offs = tl.arange(0, TILE)
        table = table_ptr + b.to(tl.int64) * table_stride
        for t in tl.range(lo, hi, num_stages=STAGES):
            pos = t * TILE + offs
            valid = (pos >= kv_start) & (pos < end)
            # in int64: an element's offset passes 2**31 in a layer of 2M tokens (8 KV heads, D=128)
            block_id = tl.load(table + pos // BS, mask=valid, other=0).to(tl.int64)
            row = (block_id * BS + pos % BS) * KV_HEADS + kvh
            acc_lo, acc_hi, m, l = _attend_tile(dq_lo, dq_hi, acc_lo, acc_hi, m, l, k_ptr, ks_ptr, kz_ptr,
                                                steps_ptr, v_ptr, vs_ptr, row, valid, qk_scale, D, K_BITS, V_BITS,
                                                NCH, CH, DOT, PREC, FP8, CAP, BLOCK_KEYS, BS * KV_HEADS, KV_HEADS)
    out = (b * HEADS + kvh * QG + qa) * (splits + WINDOW) + split
    dst = acc_ptr + out[:, None] * D + j[None, :]
    tl.store(dst, acc_lo, mask=real[:, None])
    tl.store(dst + HALF, acc_hi, mask=real[:, None])
    tl.store(m_ptr + out, m, mask=real)
    tl.store(l_ptr + out, l, mask=real)


@triton.jit(do_not_specialize=["parts"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, parts, D: tl.constexpr, CHUNK: tl.constexpr):
    """One program per (sequence, head): its ``parts`` partial results weighed by their share of
    the softmax (base 2), CHUNK at a time; a part that saw no row (m = -inf) weighs 0."""
    h = tl.program_id(0)
    d = tl.arange(0, D)
    top = tl.full([CHUNK], -float("inf"), dtype=tl.float32)
    for c in range(0, parts, CHUNK):
        i = c + tl.arange(0, CHUNK)
        top = tl.maximum(top, tl.load(m_ptr + h * parts + i, mask=i < parts, other=-float("inf")))
    m_all = tl.max(top, axis=0)
    m_all = tl.where(m_all == -float("inf"), 0.0, m_all)
    total = tl.zeros([CHUNK], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for c in range(0, parts, CHUNK):
        i = c + tl.arange(0, CHUNK)
        live = i < parts
        w = tl.exp2(tl.load(m_ptr + h * parts + i, mask=live, other=-float("inf")) - m_all)
        total += w * tl.load(l_ptr + h * parts + i, mask=live, other=0.0)
        part = tl.load(acc_ptr + (h * parts + i)[:, None] * D + d[None, :], mask=live[:, None], other=0.0)
        acc += tl.sum(part * w[:, None], axis=0)
    tl.store(out_ptr + h * D + d, (acc / tl.sum(total, axis=0)).to(out_ptr.dtype.element_ty))


MERGE_CHUNK = 16


def decode_config(fmt: KVFormat, head_dim: int = 128) -> tuple[int, int]:
    """(tokens per iteration, pipeline stages). Triton 3.9's pipeliner gives the K/V loads, which
    depend on a block id loaded a stage earlier, stages - 3 buffers (at least 1; read off the
    compiled kernels): 3 and 4 stages keep one tile requested ahead, 5 keep two but cost 10-40 more
    registers and twice the shared memory, which on sm_90 takes int4 and k8v4 from 4 programs an
    SM to 3 (and fp16 on sm_89 from 2 to 1). One tile ahead in 4 programs is 34-128 KB in flight
    per SM, against the ~33 KB an H200 SM needs (``kvchat bench kernels``); per precision, so
    that a GPU run can move one of them alone. A head_dim past 128 (Gemma's 256) reads tiles of as
    many bytes as 128's: at 64 tokens of 256 dims the 8B-shaped kernel took 162-183 registers and
    ran 1-2 programs an SM (sm_89, sm_90)."""
    tile = DECODE_TILES.get(fmt.name, DECODE_TILE)
    return max(16, tile * 128 // max(head_dim, 128)), DECODE_STAGES[fmt.name]
_SM_COUNT: dict = {}


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few splits, so that the tests merge some
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]


def decode_splits(sms: int, batch: int, kv_heads: int, max_tokens: int, tile: int = DECODE_TILE) -> int:
    """Splits of the context per (sequence, KV head): enough programs to fill every SM
    PROGRAMS_PER_SM times, never more than the tiles ``max_tokens`` makes. For a captured step
    ``max_tokens`` is the bucket's, and past SMs x PROGRAMS_PER_SM tiles the count stops growing:
    the bucket's padding costs no programs."""
    want = -(-sms * PROGRAMS_PER_SM // (batch * kv_heads))
    return max(1, min(want, -(-max_tokens // tile)))


def dot_dtypes(tensors: dict, fmt: KVFormat, window_dtype=None) -> tuple:
    """(DOT, W_DOT, PREC) for the decode kernel. Codes of int8/int4 are exact in fp16 (and the
    probabilities in [0, 1] lose less there than in bf16); an unquantized pool's rows go in as they
    are. fp32 (a CPU pool in the tests) stays fp32, "ieee": on a GPU it would round to TF32. Under
    the interpreter every product is fp32, where bf16 dots and int8->bf16 casts come out wrong."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        return tl.float32, tl.float32, "ieee"
    pool = tensors["k"].dtype if not fmt.quantized else (window_dtype or torch.float16)
    to_tl = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
    dot = tl.float16 if fmt.quantized else to_tl[pool]
    wdot = to_tl[window_dtype] if window_dtype is not None else dot
    return (tl.float32, tl.float32, "ieee") if tl.float32 in (dot, wdot) else (dot, wdot, "tf32")


def paged_decode(query: torch.Tensor, tensors: dict, fmt: KVFormat, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, rotation: torch.Tensor | None = None,
                 k_channel_scale: torch.Tensor | None = None, window: tuple | None = None,
                 splits: int | None = None, band: Band = PLAIN) -> torch.Tensor:
    """One new token per sequence: query ``[B, heads, D]``, block_tables ``[B, max_blocks]``.
    The context is split over ``splits`` programs per KV head (default: ``decode_splits`` for
    this device and the table's width), merged by their log-sum-exp in ``_merge_kernel``.
    ``window`` (B = 1): ``(K, V, sinks, wmeta)``, a layer's full-precision rows
    (``engine.kv.recent_window.RecentWindow``: ``sinks`` sink rows then a ring of the newest, ``[rows, kv_heads, D]``)
    holding positions ``0 .. s`` and ``first ..``, with ``wmeta`` int32 ``[s, first, ring row]``; the
    kernel reads the pool only between them. ``band``: the layer's sliding window and soft cap, as
    in ``reference.paged_attention``."""
    batch, heads, d = query.shape
    check_pool(tensors, fmt, d)
    _, bs, kv_heads, _ = tensors["k"].shape
    q = query.float()
    if k_channel_scale is not None:
        q = q / k_channel_scale.float().repeat_interleave(heads // kv_heads, 0)
    if fmt.k_bits < 16:
        q = q @ rotation.float()
    q = q.contiguous()
    tile, stages = decode_config(fmt, d)
    assert not fmt.block_keys or tile == bs, "int4 keys: a tile is one block (its statistics)"
    if splits is None:
        splits = decode_splits(sm_count(query.device), batch, kv_heads, block_tables.shape[1] * bs, tile)
    extra = window is not None
    parts = splits + extra
    acc = torch.empty(batch, heads, parts, d, device=q.device, dtype=torch.float32)
    m = torch.empty(batch, heads, parts, device=q.device, dtype=torch.float32)
    l = torch.empty_like(m)
    wk, wv, sinks, wmeta = window if extra else (tensors["k"], tensors["k"], 0, context_lens)
    group = heads // kv_heads
    dot, wdot, prec = dot_dtypes(tensors, fmt, wk.dtype if extra else None)
    block_keys = fmt.block_keys
    _paged_decode_kernel[(batch, kv_heads, parts)](
        q, tensors["k"], tensors.get("k_scale", tensors["k"]), tensors["k_zero"] if block_keys else tensors["k"],
        int4.steps(q.device) if block_keys else q, tensors["v"], tensors.get("v_scale", tensors["k"]),
        block_tables, context_lens, acc, m, l, wk, wv, wmeta, scale * LOG2E, block_tables.stride(0), splits,
        HEADS=heads, KV_HEADS=kv_heads, D=d, BS=bs, K_BITS=fmt.k_bits, V_BITS=fmt.v_bits,
        CH=min(quant.GROUP, d // 2), QG=group, QG_PAD=max(QG_MIN, triton.next_power_of_2(group)), TILE=tile,
        STAGES=stages, DOT=dot, W_DOT=wdot, PREC=prec, WINDOW=extra, W_SINKS=sinks,
        W_SIZE=max(1, wk.shape[0] - sinks) if extra else 1, FP8=fp8_mode(fmt, q.device), SLIDE=band.window or 0,
        CAP=band.softcap * LOG2E if band.softcap else 0.0, BLOCK_KEYS=block_keys, num_warps=DECODE_WARPS)
    rotate_back = fmt.v_bits < 16
    out = torch.empty(batch, heads, d, device=q.device, dtype=torch.float32 if rotate_back else query.dtype)
    _merge_kernel[(batch * heads,)](acc, m, l, out, parts, D=d, CHUNK=MERGE_CHUNK)
    return (out @ rotation.float()).to(query.dtype) if rotate_back else out


LOG2E = 1.4426950408889634



# ``first`` and ``n`` move with every prefill chunk: specializing on them would compile again mid-prompt.
