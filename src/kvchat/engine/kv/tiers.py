"""The pool's two lower tiers working as one: a block evicted from the pool is copied to host RAM,
a block leaving RAM goes to disk, and a request's prefix is matched pool -> RAM -> disk, what is
found loaded back into pool blocks so that only the rest is computed.

Every tier is keyed by the prefix cache's chained block hash, so a hit is a whole prefix and a
block restored is the bytes that were evicted: greedy tokens are those of a pool that never
evicted. A chain's first block of a quantized pool carries its full-precision sink rows."""
import hashlib
import logging

import torch

from kvchat.kernels.quant import SINKS

from kvchat.engine.kv.block_pool import Block, PoolExhausted
from kvchat.engine.kv.disk_tier import PINNED, DiskTier
from kvchat.engine.kv.host_tier import HostTier, StoredBlock, copy_in, copy_out
from kvchat.engine.kv.manager import Sequence

log = logging.getLogger("kvchat.tiers")


class KVTiers:
    def __init__(self, kvpool, host: HostTier, disk: DiskTier | None, notice=None):
        self.kvpool = kvpool  # its cache and manager are read live: a rebuild replaces them
        self.host, self.disk = host, disk
        self.notice = notice or (lambda kind, message: log.warning("%s: %s", kind, message))
        self.host_hits = 0  # blocks restored from each tier
        self.disk_hits = 0
        self._restoring: set[int] = set()  # ids of the blocks a restore found: their buffers stay theirs

    @property
    def block_size(self) -> int:
        return self.kvpool.block_size

    @property
    def idle(self) -> bool:
        """The tiers keep the whole-context layers' rows: a pool wholly in rings has none to keep."""
        return not self.kvpool.kv.whole()

    # -- down: pool -> RAM -> disk --

    def evicted(self, block: Block) -> None:
        """The pool's hook: ``block`` is about to be reused. Its bytes go to RAM (a full block
        only: a partly filled tail is never matched by hash)."""
        if len(block.token_ids) != self.block_size or self.host.cap_bytes == 0 and self.disk is None or self.idle:
            return
        try:
            if block.hash in self.host:
                return self.host.touch(block.hash)
            self._spill(self.host.put(block.hash, self._stored(block.id, block.token_ids, block.parent)))
        except Exception:  # a tier must never cost the request its allocation
            log.exception("could not keep an evicted block")

    def _stored(self, block_id: int, token_ids, parent: bytes | None) -> StoredBlock:
        kv = self.kvpool.kv
        block = copy_out(kv.whole_layers, block_id, self.host.buffers)  # a ring's rows are its sequence's
        block.token_ids, block.parent = tuple(token_ids), parent
        if parent is None and kv.format.quantized:
            sinks = kv.sink_cache.get(tuple(token_ids[:SINKS]))
            block.sinks = tuple(t.to("cpu", copy=True) for t in sinks) if sinks is not None else None
        return block

    def _spill(self, blocks: list[tuple[bytes, StoredBlock]]) -> None:
        """Blocks leaving RAM go to disk, unless a finished turn already wrote them there; their
        buffers then go to the next block evicted."""
        for hash_, block in blocks:
            if self.disk is not None and not self.disk.has(hash_):
                self._save(hash_, block)
            if id(block) not in self._restoring:  # pushed out by the restore's own reservation: still read
                block.release()
        if blocks and self.disk is not None:
            self.disk.trim()

    def _save(self, hash_: bytes, block: StoredBlock, pinned: bool = False) -> None:
        was_full = self.disk.full
        try:
            self.disk.save(hash_, self.kvpool.manager.extra_key, block, pinned)
        except OSError as e:
            log.warning("could not write a KV block to %s: %s", self.disk.folder, e)
        if self.disk.full and not was_full:
            self.notice("disk-full", f"the disk is full: conversations are no longer saved to {self.disk.folder} "
                                     "(chats go on; clear cached conversations or free space)")

    def persist(self, seq: Sequence, persona_blocks: int = 0) -> None:
        """A finished turn: its full blocks that the disk does not hold yet are written there, the
        first ``persona_blocks`` (a persona's, shared by its chats) pinned: trimmed last, kept by
        "Clear cached conversations"."""
        if self.disk is None or self.disk.full or self.idle:
            return
        parents, bs, wrote = [None] + seq.hashes[:-1], self.block_size, False
        for i, h in enumerate(seq.hashes):
            pinned, held = i < persona_blocks, self.disk.find(h)
            if held is not None:
                if pinned and held.suffix != PINNED:  # written plain by a turn before it was a persona's
                    self.disk.pin(h)
                continue
            block = self._stored(seq.blocks[i].id, seq.token_ids[i * bs:(i + 1) * bs], parents[i])
            self._save(h, block, pinned)
            block.release()
            wrote = True
            if self.disk.full:
                break
        if wrote:
            self.disk.trim()

    def persist_ring(self, hash_: bytes, token_ids: list[int], rows) -> None:
        """A windowed model's persona ring (``ring_prefix``), its windowed layers' rows (``rows()``,
        read only where they will be written), pinned on disk beside the persona's blocks, named
        after its last one (``hash_``)."""
        if self.disk is None or self.disk.full or self.idle or self.holds_ring(hash_):
            return
        self._save(ring_name(hash_), StoredBlock(tuple(token_ids), None, rows()), pinned=True)
        self.disk.trim()

    def stored_ring(self, hash_: bytes, token_ids: list[int]) -> dict[str, torch.Tensor] | None:
        """The tensors of the persona ring kept at the block named ``hash_`` (``token_ids`` up to
        its end), where the disk holds it."""
        if not self.holds_ring(hash_):
            return None
        ring = self.disk.load(ring_name(hash_), self.kvpool.manager.extra_key, token_ids)
        return ring.tensors if ring is not None else None

    def holds_ring(self, hash_: bytes) -> bool:
        """Whether the disk has the persona ring kept at the block named ``hash_``."""
        return self.disk is not None and not self.idle and self.disk.has(ring_name(hash_))

    def holds(self, hash_: bytes) -> bool:
        """Whether RAM or disk has this block: a match would restore it, not compute it."""
        return hash_ in self.host or self.disk is not None and self.disk.has(hash_)

    # -- up: RAM, disk -> pool --

    def restore(self, seq: Sequence) -> tuple[int, int]:
        """After the pool's own match: the chain's next blocks from RAM, then disk, loaded into
        pool blocks and published. Returns the tokens restored from RAM and from disk."""
        if not self.host.entries and self.disk is None or self.idle:
            return 0, 0
        manager, bs = self.kvpool.manager, self.block_size
        have = len(seq.blocks)
        if have != len(seq.hashes) or seq.num_computed != have * bs:
            return 0, 0
        found, sources = [], []
        for i, (chunk, h) in enumerate(manager.chain(seq.token_ids, (len(seq) - 1) // bs)):
            if i < have:
                continue
            block = self.host.get(h, chunk)
            source = "host"
            if block is None and self.disk is not None:
                block, source = self.disk.load(h, manager.extra_key, chunk), "disk"
            if block is None:
                break
            found.append(block)
            sources.append(source)
        if not found:
            return 0, 0
        self._restoring = {id(block) for block in found}
        try:
            manager.reserve(seq, (have + len(found)) * bs)  # may evict blocks into RAM, and push these out
            if not self._write(seq, have, found):
                return 0, 0
        except PoolExhausted:
            return 0, 0
        finally:
            self._restoring = set()
        seq.num_computed = (have + len(found)) * bs
        manager.commit(seq)
        ram = sources.count("host")
        self.host_hits += ram
        self.disk_hits += len(found) - ram
        return ram * bs, (len(found) - ram) * bs

    def _write(self, seq: Sequence, have: int, found: list[StoredBlock]) -> bool:
        kv = self.kvpool.kv
        want = {n: ((len(kv.whole_layers), 1, *t.shape[1:]), t.dtype) for n, t in kv.layers[0].items()}
        for block in found:
            if {n: (tuple(t.shape), t.dtype) for n, t in block.tensors.items()} != want:
                log.warning("a stored KV block does not fit this pool (another layout): a miss")
                return False
        ids = [b.id for b in seq.blocks[have:have + len(found)]]
        if kv.device.type == "cuda":
            copy_in(found, lambda tensors: kv.write_blocks(ids, tensors), list(want), kv.device)
        else:  # straight into the pool's rows: no stacked copy of the whole restore first
            for i, layer in enumerate(kv.whole_layers):
                for n, t in layer.items():
                    for block_id, block in zip(ids, found):
                        t[block_id].copy_(block.tensors[n][i, 0])
        if have == 0 and found[0].sinks is not None:
            kv.keep_sinks(seq.token_ids, *found[0].sinks)
        return True

    # -- privacy --

    def forget(self, hashes) -> int:
        """Delete these blocks from RAM and disk (the pool's own copies are the caller's)."""
        gone = 0
        for h in hashes:
            gone += self.host.discard(h)
            if self.disk is not None:
                gone += self.disk.discard(h)
        return gone

    def clear(self) -> int:
        n = len(self.host)
        self.host.clear()
        return n + (self.disk.clear() if self.disk is not None else 0)

    def usage(self) -> dict:
        disk = self.disk
        return {"ram_used": self.host.used, "ram_capacity": self.host.cap_bytes, "ram_hits": self.host_hits,
                "disk_used": disk.used if disk else 0, "disk_capacity": disk.cap_bytes if disk else 0,
                "disk_hits": self.disk_hits}


def ring_name(hash_: bytes) -> bytes:
    """The disk's name for the persona ring kept at the block named ``hash_``: the block's own
    hash covers the model, layout and every token, so the ring's does too."""
    return hashlib.blake2b(hash_ + b"|ring", digest_size=len(hash_)).digest()
