"""The KV pool as one unit: tensors, blocks, prefix cache and personas, rebuilt in place (no
weights reload) when the precision or the byte budget changes."""
import logging

import torch

from kvchat.engine.kv.block_pool import BlockPool
from kvchat.kernels import quant
from kvchat.engine.kv.calibration import calibrate
from kvchat.core.config import BLOCK_SIZE, ConfigError, Precision
from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.convert import converted
from kvchat.core.kv_sizes import KVShape, bytes_per_token, pool_blocks, pool_nbytes, quantizable
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.host_tier import HostTier
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.kv.personas import PersonaCache
from kvchat.engine.kv.ring_prefix import RingPrefix
from kvchat.engine.kv.rings import Rings
from kvchat.engine.kv.tiers import KVTiers
from kvchat.engine.model.runner import ModelRunner

log = logging.getLogger("kvchat.kv_pool")


def kv_dtype(lm) -> torch.dtype:
    """What the fp16 mode stores: the model's dtype, unless that is not a float the pool can hold."""
    return lm.dtype if lm.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16


class KVPool:
    def __init__(self, lm, block_size: int, precision: Precision, budget: int, decode: str = "eager",
                 host_cap: int = 0, disk: DiskTier | None = None, notice=None, local_blocks: int | None = None,
                 span: int = 0):
        self.lm, self.block_size, self.budget = lm, block_size, budget
        self.span = span  # the context it serves, in tokens: a pool wholly in rings has that many ids
        self.shape = KVShape.from_config(lm.model.config)
        self.dtype = kv_dtype(lm)
        self.quantizable = quantizable(self.shape)
        self.refuse(precision)
        # the windowed layers' ring blocks (kv/rings.py): given (the host's ``ring_blocks`` for
        # its context; 0: none), or None for the budget to decide (kv_sizes.pool_blocks)
        if local_blocks is None:
            local_blocks = pool_blocks(self.shape, precision, block_size, budget, self.full_bytes(), span=span)[1]
        self.local_blocks = local_blocks
        num_blocks = self.blocks_for(precision, budget)
        self.kv = KVCache(self.shape, num_blocks, block_size, self.dtype, lm.device, precision, self.local_blocks)
        self.kv.calibrated(*self.key_stats(precision))
        self.blocks = BlockPool(num_blocks)
        self.manager = KVCacheManager(self.blocks, block_size, self.extra_key())
        self.rings = None
        self._new_rings()
        self.runner = ModelRunner(lm.model, self.kv, self.manager, decode)
        self.personas = PersonaCache(self.manager)
        self.ring_prefix = RingPrefix(self)
        self.tiers = KVTiers(self, HostTier(host_cap, lm.device), disk, notice)
        if self.tiers.host.cap_bytes or disk is not None:  # host_cap None: the default share of RAM
            self.blocks.on_evict = self.tiers.evicted

    @classmethod
    def for_tokens(cls, lm, num_tokens: int, precision: Precision, block_size: int = BLOCK_SIZE) -> "KVPool":
        """A scratch pool with room for exactly one sequence of ``num_tokens`` (evaluation)."""
        per_token = bytes_per_token(KVShape.from_config(lm.model.config), precision, kv_dtype(lm).itemsize)
        return cls(lm, block_size, precision, int(-(-num_tokens // block_size) * block_size * per_token),
                   local_blocks=0)

    def _new_rings(self) -> None:
        self.rings = Rings(self.shape, self.block_size, self.local_blocks,
                           lambda ids, ring: self.kv.place(ids, ring)) if self.local_blocks else None
        self.manager.rings = self.rings

    @property
    def precision(self) -> Precision:
        return self.kv.precision

    def extra_key(self) -> str:
        return f"{self.lm.identity}|{self.kv.layout_key}"

    def full_bytes(self) -> int:
        return self.dtype.itemsize

    def refuse(self, precision: Precision) -> None:
        """ConfigError for a precision this model's K/V cannot take (``kv_sizes.quantizable``)."""
        if quant.FORMATS[Precision(precision).value].quantized and not self.quantizable:
            raise ConfigError(f"KV precision {Precision(precision).value} needs a head_dim that is a power of two; "
                              f"this model's is {self.shape.head_dim}: use fp16")

    def blocks_for(self, precision: Precision, budget: int, local_blocks: int | None = None,
                   span: int | None = None) -> int:
        """Whole-context blocks in ``budget`` beside the rings (``local_blocks``, else the pool's)."""
        n = self._blocks(precision, budget, local_blocks, span)
        if n < 1:
            raise ConfigError("the KV budget is smaller than one block")
        return n

    def _blocks(self, precision: Precision, budget: int, local_blocks: int | None = None,
                span: int | None = None) -> int:
        local = self.local_blocks if local_blocks is None else local_blocks
        return pool_blocks(self.shape, precision, self.block_size, budget, self.full_bytes(), local,
                           self.span if span is None else span)[0]

    def tokens_for(self, precision: Precision, budget: int | None = None) -> int:
        """What ``budget`` holds at ``precision`` beside the pool's rings; 0 when not one block."""
        return self._blocks(precision, self.budget if budget is None else budget) * self.block_size

    def nbytes_for(self, precision: Precision, budget: int, local_blocks: int | None = None,
                   span: int | None = None) -> int:
        """What the pool would take at ``precision`` in ``budget``: its blocks, its rings."""
        local = self.local_blocks if local_blocks is None else local_blocks
        return pool_nbytes(self.shape, precision, self.blocks_for(precision, budget, local, span), local,
                           self.full_bytes(), self.block_size)

    def _nbytes(self, blocks: int, ring_blocks: int) -> int:
        """Bytes of ``blocks`` of this pool and ``ring_blocks`` of its rings."""
        return pool_nbytes(self.shape, self.precision, blocks, ring_blocks, self.full_bytes(), self.block_size,
                           bool(self.local_blocks))

    def bytes_per_token(self, precision: Precision | None = None) -> float:
        return bytes_per_token(self.shape, precision or self.precision, self.full_bytes())

    def key_stats(self, precision: Precision):
        """The model's key statistics, for the modes that use them (computed once per model:
        ``calibration.calibrate``); int4 computes its own per block, fp16 has none."""
        fmt = quant.FORMATS[Precision(precision).value]
        if not fmt.quantized or fmt.block_keys:
            return None, None, None
        return calibrate(self.lm, KVPool.for_tokens)

    def rebuild(self, precision: Precision, budget: int, live: list[Sequence] = (),
                local_blocks: int | None = None, span: int | None = None) -> bool:
        """Convert the pool to ``precision`` within ``budget`` bytes, keeping cached prefixes and
        the live sequences' blocks. False when the live blocks would not fit. Allocate new,
        convert, swap, free old: until the swap nothing but a compaction's block copies touches
        this pool, so an error before it (calibration, allocation, conversion) leaves the pool, its
        blocks and the live sequences' windows as they were."""
        precision = Precision(precision)
        self.refuse(precision)
        local = self.local_blocks if local_blocks is None else local_blocks
        reringed = local != self.local_blocks
        if reringed and (live or self.rings is not None and self.rings.available() < self.local_blocks):
            return False  # running sequences' windowed rows would be lost: change them between replies
        n = self.blocks_for(precision, budget, local, span)
        if n < self.blocks.num_blocks and not self._clear_tail(n):
            return False
        stats = self.key_stats(precision)
        windows = self._new_windows(precision, live)
        new_kv = converted(self.kv, precision, n, *stats, windows=[fill for _, _, fill in windows if fill],
                           local_blocks=local)
        for seq, window, _ in windows:
            seq.window = window
        if n < self.blocks.num_blocks:
            self.blocks.shrink(n)  # cannot fail: _clear_tail moved every live block below n
        self.kv = new_kv
        self.blocks.grow(n)
        self.budget, self.span = budget, self.span if span is None else span
        self.manager.relayout(self.extra_key(), list(live))
        self.runner.kv = self.kv
        self.personas.pinned.clear()  # keyed by old hashes; the blocks keep their pinned flag
        if reringed:  # the cached blocks' windowed rows are in rings no longer kept, or in none
            self.local_blocks = local
            self._new_rings()
            self.clear_cache()
        return True

    def clear_cache(self) -> None:
        """Forget every cached prefix no sequence holds: the blocks' and the kept rings'."""
        self.blocks.clear_cache()
        if self.rings is not None:
            self.rings.forget(personas=True)

    def _clear_tail(self, n: int) -> bool:
        """Move live blocks off the ids a shrink to ``n`` blocks drops (data copied within this
        pool, to free ids); False when too few ids below ``n`` are free."""
        if not any(b.ref_cnt for b in self.blocks.blocks[n:]):
            return True
        moves = self.blocks.compact(n)
        if moves is None:
            return False
        self.kv.move_blocks(moves)
        return True

    def _new_windows(self, precision: Precision, live) -> list:
        """Live sequences keep their newest tokens in full precision through a conversion: a
        window stays valid between int modes (they transform keys alike); otherwise a new one is
        filled from the old pool (exact from fp16; from fp8 or an int mode, its rounded rows).
        Returns ``(seq, new window, what to fill)`` for the sequences whose window changes; the
        caller sets them once the conversion succeeded."""
        out = []
        old, new = self.kv.format.transform, quant.FORMATS[Precision(precision).value].transform
        for seq in live:
            if not (old and old == new):
                window = self.kv.new_window(precision)
                fill = (window, [b.id for b in seq.blocks], seq.num_computed) if window is not None else None
                out.append((seq, window, fill))
        return out

    def match(self, seq: Sequence, persona_len: int = 0) -> tuple[int, int]:
        """A new request's cached prefix: the pool's blocks, then RAM's and disk's (loaded back),
        a partly filled block (its first ``persona_len`` tokens a persona's). Returns the tokens
        restored from RAM and disk."""
        seq.ring_clean = self.rings is None  # a ring holds the matched tokens' rows once taken over
        pooled = self.manager.match_prefix(seq)
        seq.matching = True  # a restore's blocks take no ring: the kept one that holds them comes after
        try:
            ram, disk = self.tiers.restore(seq)
            self.manager.match_tail(seq, copy=lambda src, dst: self.kv.move_blocks({src: dst}))
        finally:
            seq.matching = False
        if self.rings is not None and seq.num_computed and not self.ring_prefix.take(seq, persona_len):
            self.manager.free(seq)  # no ring holds the windowed layers' rows: compute it all
            seq.hashes, seq.num_computed = [], 0
        if seq.num_computed < pooled + ram + disk:  # the tiers' blocks past it are computed again
            ram = min(ram, max(0, seq.num_computed - pooled))
            disk = min(disk, max(0, seq.num_computed - pooled - ram))
        seq.ring_clean = True
        return ram, disk

    def release(self, seq: Sequence, persona_len: int = 0) -> None:
        """A reply's end (never before its first token), ``match``'s other half: the persona
        pinned, the turn's new full blocks persisted (a restart resumes), the blocks freed but the
        last computed token's, where the next turn goes on."""
        persona_blocks = 0
        try:
            persona_blocks = self.personas.remember(seq, persona_len)
        except Exception:
            log.exception("could not remember the persona")
        self.tiers.persist(seq, persona_blocks)
        self.ring_prefix.persist()  # a windowed model's new persona ring beside them
        self.manager.free(seq, keep_tail=True)

    def usage(self) -> dict:
        pool, rings = self.blocks, self.rings
        # the windowed layers' blocks: rings of running requests, and kept ones for next turns
        kept = rings.kept_blocks() if rings is not None else 0
        held = self.local_blocks - len(rings.free) - kept if rings is not None else 0
        return {"kv_total": self._nbytes(pool.num_blocks, self.local_blocks),
                "kv_in_use": self._nbytes(pool.num_blocks - pool.num_free, held),
                "kv_reclaimable": self._nbytes(pool.num_reclaimable, kept), "tiers": self.tiers.usage()}
