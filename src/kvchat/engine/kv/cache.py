"""The physical KV pool: per-layer tensors allocated once for a precision, and their size in bytes."""
from collections import OrderedDict

import torch

from kvchat.kernels import dispatch, int4, quant
from kvchat.kernels.reference import PLAIN, Band

from kvchat.core.config import Precision
from kvchat.engine.kv.calibration import CALIBRATION_ID, FP8_TARGET
from kvchat.core.kv_sizes import SINK_CACHE_ENTRIES, KVShape, ring_blocks
from kvchat.engine.kv.recent_window import RecentWindow, WindowStorage

MAX_COPY_RUNS = 8  # a ring copied in more pieces than this goes by index


class KVCache:
    def __init__(self, shape: KVShape, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device, precision: Precision = Precision.FP16, local_blocks: int = 0):
        self.shape, self.num_blocks, self.block_size = shape, num_blocks, block_size
        self.precision, self.dtype = Precision(precision), dtype
        self.format = quant.FORMATS[self.precision.value]
        self.ringed(local_blocks, device)
        self.layers = [quant.layer_tensors(self.format, self.blocks_of(i), block_size, shape.num_kv_heads,
                                           shape.head_dim, dtype, device) for i in range(shape.num_layers)]
        self.rotation = quant.hadamard(shape.head_dim, device) if self.format.quantized else None
        self.k_centers: list[torch.Tensor] | None = None  # set by calibration, quantized modes only
        self.k_scales: list[torch.Tensor] | None = None  # likewise: per-channel key scale
        self.fp8_scales: list[torch.Tensor] | None = None  # likewise, fp8 only: [2, kv_heads], K and V
        self._key_scales: list[torch.Tensor] | None = None
        self.sink_cache: OrderedDict[tuple, tuple] = OrderedDict()  # first token ids -> full-precision sinks
        # the full-precision rows each new sequence's window takes over once the last one's
        # sequence ended: a captured CUDA graph reads them, so a new reply replays the graphs it has
        self.window_storage: WindowStorage | None = None

    def ringed(self, local_blocks: int, device) -> None:
        """With ``local_blocks``, the windowed layers hold that many blocks, the sequences' rings
        (``rings.Rings``), and ``block_map`` sends each block id to the ring block its rows are in."""
        self.local = frozenset(self.shape.local_layers) if local_blocks else frozenset()
        self.local_blocks, self.ring_size = local_blocks, ring_blocks(self.shape, self.block_size) if local_blocks else 0
        self.block_map = torch.zeros(self.num_blocks, dtype=torch.long, device=device) if local_blocks else None

    def blocks_of(self, layer: int) -> int:
        return self.local_blocks if layer in self.local else self.num_blocks

    def whole(self) -> list[int]:
        """The layers that keep the whole context, addressed by block id."""
        return [i for i in range(self.shape.num_layers) if i not in self.local]

    @property
    def whole_layers(self) -> list[dict]:
        return [self.layers[i] for i in self.whole()]

    def place(self, block_ids: list[int], ring_ids: list[int]) -> None:
        """The windowed layers' rows of these blocks are in these ring blocks."""
        if block_ids:
            index = torch.tensor(block_ids, device=self.block_map.device)
            self.block_map.index_copy_(0, index, torch.tensor(ring_ids, device=index.device))

    def copy_ring(self, source: list[int], target: list[int]) -> None:
        """The windowed layers' rows of ring blocks ``source`` into ring blocks ``target`` (two
        rings: no block in both), a run of consecutive ids on both sides at a time. Rings are taken
        from the free list in order, so they are mostly one run; index_select first copied the
        source rows out of each tensor: Gemma-2-9B's fp32 ring (1.41 GB) took 750 ms on 2 cores,
        85 ms in runs. A ring in many pieces still goes by index (a launch per run on a GPU)."""
        assert len(source) == len(target), (len(source), len(target))
        runs, start = [], 0
        for j in range(1, len(source) + 1):
            if j == len(source) or source[j] != source[j - 1] + 1 or target[j] != target[j - 1] + 1:
                runs.append((source[start], target[start], j - start))
                start = j
        by_index = len(runs) > MAX_COPY_RUNS
        if by_index:
            device = self.block_map.device
            src, dst = torch.tensor(source, device=device), torch.tensor(target, device=device)
        for i in self.local:
            for t in self.layers[i].values():
                if by_index:
                    t.index_copy_(0, dst, t.index_select(0, src))
                    continue
                for s, d, n in runs:
                    t[d:d + n].copy_(t[s:s + n])

    def _ring_slots(self, slots: torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        mapped = self.block_map.index_select(0, slots.clamp(min=0).div(bs, rounding_mode="floor")) * bs + slots % bs
        return torch.where(slots >= 0, mapped, slots)  # -1 stays: a capture's write that goes nowhere

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    @property
    def layout_key(self) -> str:
        """What the prefix-cache hash must cover besides the model: the bytes in a block."""
        ringed = f"|whole-context layers {self.whole()}" if self.local else ""  # a block holds only those
        return f"{self.precision.value}|{self.dtype}{format_id(self.format)}{ringed}"

    def calibrated(self, k_centers=None, k_scales=None, fp8_scales=None) -> None:
        """Set the key statistics (``calibration.calibrate``) this pool's format uses (int4's
        keys have their own per block: none)."""
        quantized = self.format.quantized and not self.format.block_keys
        self.k_centers, self.k_scales = (k_centers, k_scales) if quantized else (None, None)
        self.fp8_scales = fp8_scales if self.format.float8 else None
        self._key_scales = self.k_scales
        if self.fp8_scales is not None:
            self._key_scales = [s / f[0, :, None] for s, f in zip(self.k_scales, self.fp8_scales)]

    def key_scale(self, layer: int) -> torch.Tensor | None:
        """The keys' channel scale; in fp8 with the layer's scale folded in (queries divide by it)."""
        return self._key_scales[layer] if self._key_scales is not None else None

    def value_scale(self, layer: int) -> torch.Tensor | None:
        """fp8's per-KV-head value scale ``[kv_heads, 1]``: values are divided by it before the
        write, and attention's output multiplied by it."""
        return self.fp8_scales[layer][1, :, None] if self.fp8_scales is not None else None

    @property
    def device(self) -> torch.device:
        return self.layers[0]["k"].device

    def read_blocks(self, block_ids: list[int], layers: list[int] | None = None) -> dict[str, torch.Tensor]:
        """Every tensor that a block id addresses, stacked over the whole-context layers (or
        ``layers``: the windowed ones for ring block ids): ``[layers, n, ...]``."""
        index = torch.tensor(block_ids, device=self.rotation.device if self.rotation is not None else None)
        which = [self.layers[i] for i in (self.whole() if layers is None else layers)]
        return {n: torch.stack([layer[n].index_select(0, index.to(layer[n].device)) for layer in which]).cpu()
                for n in which[0]}

    def write_blocks(self, block_ids: list[int], tensors: dict[str, torch.Tensor],
                     layers: list[int] | None = None) -> None:
        """``read_blocks``' tensors back into these block ids; ValueError, nothing written, where
        they are not this pool's layout."""
        which = [self.layers[i] for i in (self.whole() if layers is None else layers)]
        if set(tensors) != set(which[0]):
            raise ValueError(f"stored tensors {sorted(tensors)} are not this pool's {sorted(which[0])}")
        for name, data in tensors.items():
            want = (len(which), len(block_ids), *which[0][name].shape[1:])
            if tuple(data.shape) != want or data.dtype != which[0][name].dtype:
                raise ValueError(f"stored {name} is {tuple(data.shape)} {data.dtype}, the pool wants {want}")
        for layer_idx, layer in enumerate(which):
            for name, t in layer.items():
                index = torch.tensor(block_ids, device=t.device)
                t.index_copy_(0, index, tensors[name][layer_idx].to(t.device))

    def new_window(self, precision: Precision | None = None, take: bool = True) -> RecentWindow | None:
        """A sequence's full-precision window of newest tokens, on the pool's window storage (it
        takes the rows over unless told not to: a capture borrows them); rows of its own while a
        running sequence's window holds the pool's (a batch). The fp16 mode needs none."""
        if not quant.FORMATS[Precision(precision or self.precision).value].quantized:
            return None
        device = next(iter(self.layers[0].values())).device
        if self.window_storage is None:
            self.window_storage = WindowStorage(self.shape.num_layers, quant.SINKS + quant.WINDOW,
                                                      self.shape.num_kv_heads, self.shape.head_dim, self.dtype, device)
        holder = self.window_storage.holder()
        storage = self.window_storage if holder is None or holder.released or not take else None
        return RecentWindow(self.shape.num_layers, self.shape.num_kv_heads, self.shape.head_dim, self.dtype,
                                  device, storage=storage, take=take)

    def move_blocks(self, moves: dict[int, int]) -> None:
        """Copy blocks to new ids (a compaction before a shrink): ``{old id: new id}``."""
        if not moves:
            return
        device = next(iter(self.layers[0].values())).device
        old, new = (torch.tensor(ids, device=device) for ids in zip(*moves.items()))
        for layer in self.whole_layers:
            for t in layer.values():
                t.index_copy_(0, new, t.index_select(0, old))
        if self.block_map is not None:  # a ring's rows stay where they are: the new id points at them
            self.block_map.index_copy_(0, new, self.block_map.index_select(0, old))

    def window_for(self, token_ids: list[int], computed: int) -> RecentWindow | None:
        """A new window for a sequence of which ``computed`` tokens are already in the pool (a prefix
        hit): its sinks come from the sink cache when an earlier sequence began the same way."""
        window = self.new_window()
        if window is not None and computed:
            sinks = self.sink_cache.get(tuple(token_ids[:window.sinks]))
            if sinks is not None:
                window.set_sinks(*sinks)
        return window

    def keep_sinks(self, token_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Sink rows ``[layers, sinks, kv_heads, D]`` read back from disk with a persona."""
        device = self.layers[0]["k"].device
        self.sink_cache[tuple(token_ids[:k.shape[1]])] = (k.to(device, self.dtype), v.to(device, self.dtype))
        while len(self.sink_cache) > SINK_CACHE_ENTRIES:
            self.sink_cache.popitem(last=False)

    def remember_sinks(self, token_ids: list[int], window: RecentWindow) -> None:
        key = tuple(token_ids[:window.sinks])
        if key in self.sink_cache:
            self.sink_cache.move_to_end(key)
            return
        rows = window.complete_sinks()
        if rows is not None:
            self.sink_cache[key] = rows
            if len(self.sink_cache) > SINK_CACHE_ENTRIES:
                self.sink_cache.popitem(last=False)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              window: RecentWindow | None = None, first_pos: int = 0,
              window_meta: torch.Tensor | None = None) -> tuple | None:
        """Store the new tokens' K/V; in the quantized modes, return them as transformed before
        rounding (``attend``'s ``fresh``) when there are several (a prefill chunk)."""
        center = self.k_centers[layer] if self.k_centers is not None else None
        s, v_scale = self.key_scale(layer), self.value_scale(layer)
        if v_scale is not None:
            value = value / v_scale.to(value.dtype)
        if layer in self.local:
            # a chunk longer than the ring keeps its newest rows: the others' slots are taken again
            bs = self.block_size
            skip = max(0, ((first_pos + key.shape[0] - 1) // bs - self.ring_size + 1) * bs - first_pos)
            if skip and window is not None and first_pos < window.sinks:  # the sink cache wants every layer's
                m = min(window.sinks - first_pos, skip)
                window.store(layer, first_pos, quant.transform_keys(key[:m].float(), self.rotation, center, s),
                             quant.rotate(value[:m].float(), self.rotation))
            key, value, slots, first_pos = key[skip:], value[skip:], self._ring_slots(slots[skip:]), first_pos + skip
        rows = []

        def keep_rows(k, v):
            if window is not None:
                window.store(layer, first_pos, k, v)
            rows.append((k, v))

        wanted = self.format.quantized and (window is not None or key.shape[0] > 1)
        ring = (window, layer, first_pos, window_meta) if window is not None else None
        dispatch.write_kv(self.layers[layer], self.format, key, value, slots, self.rotation, center, s,
                          keep_rows if wanted else None, ring,
                          (lambda: block_start(self, layer, slots, window, first_pos)) if self.format.block_keys else None)
        return rows[0] if rows and key.shape[0] > 1 else None

    def fresh(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> tuple:
        """New tokens' K/V as ``write`` transforms them before rounding, without writing them: a
        windowed layer's chunk attends first, then its rows may overwrite the ring's oldest."""
        v_scale = self.value_scale(layer)
        if v_scale is not None:
            value = value / v_scale.to(value.dtype)
        if not self.format.quantized:
            return key, value
        center = self.k_centers[layer] if self.k_centers is not None else None
        return (quant.transform_keys(key.float(), self.rotation, center, self.key_scale(layer)),
                quant.rotate(value.float(), self.rotation))

    def attend(self, layer: int, query: torch.Tensor, block_table: torch.Tensor, context_len: int,
               scale: float, first_block: int | None = None, window: RecentWindow | None = None,
               context_lens: torch.Tensor | None = None, fresh: tuple | None = None,
               window_meta: torch.Tensor | None = None, band: Band = PLAIN) -> torch.Tensor:
        if layer in self.local:  # the ring blocks, in the order of the sequence's blocks
            if band.window is not None and window is None and not query.is_cuda:
                # the reference path reads every row it is given: give it none before the window
                # (positions shift alike, and the band is relative; a quantized window's rows are
                # placed by position, so those keep theirs; CUDA's kernel starts at the window)
                drop = max(0, (context_len - query.shape[0] - band.window + 1) // self.block_size)
                block_table, context_len = block_table[drop:], context_len - drop * self.block_size
            index = block_table.long().clamp(0, self.num_blocks - 1)  # a captured table's padding too
            block_table, first_block = self.block_map.index_select(0, index).to(torch.int32), None
        out = dispatch.paged_attention(query, self.layers[layer], self.format, block_table, context_len, scale,
                                        first_block, self.rotation, self.key_scale(layer),
                                        None if window is None else (window, layer), context_lens, fresh, window_meta,
                                        band)
        v_scale = self.value_scale(layer)
        if v_scale is None:
            return out
        t, heads, d = out.shape  # each query head takes its KV head's scale (GQA: heads grouped by KV head)
        return (out.view(t, v_scale.shape[0], -1, d) * v_scale[:, None].to(out.dtype)).view(t, heads, d)


def format_id(fmt: quant.KVFormat) -> str:
    """What the bytes of a block depend on besides the model and the precision's name."""
    if not fmt.quantized:
        return ""
    if fmt.block_keys:
        return f"|wht|block-keys-{int4.STEP_CODES}-{int4.STEP_BIAS}|v{quant.GROUP}-window{quant.WINDOW}"
    calibrated = f"|wht{quant.GROUP}|centred-scaled-clip-window{quant.WINDOW}|{CALIBRATION_ID}"
    return calibrated + (f"|fp8-at-{FP8_TARGET}" if fmt.float8 else "")


def block_start(kv: KVCache, layer: int, slots: torch.Tensor, window, first_pos: int) -> tuple | None:
    """With per-block key statistics, a write that starts inside a block quantizes the block again
    from its first row: those earlier rows ``(K, slots)`` (``quant.write``'s ``prior``), from the
    window where it holds them (exact), else read back from the pool."""
    m = first_pos % kv.block_size
    if not kv.format.block_keys or not m or int(slots[0]) < 0:
        return None
    earlier = slots[0] - m + torch.arange(m, device=slots.device)
    held = window.keys(layer, first_pos - m, first_pos) if window is not None else None
    return (held if held is not None else quant.read_slots(kv.layers[layer], kv.format, "k", earlier)), earlier
