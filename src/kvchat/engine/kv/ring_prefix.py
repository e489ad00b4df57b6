"""A windowed model's prefix cache on top of its rings (``rings.Rings`` keeps them): which kept
ring a request goes on from, and the copies of rings made for later: a prompt's (for a
regenerate) and a persona's (for every chat on it, and on disk for the next start).

A request's cached blocks serve its windowed layers only through a ring that holds their window.
Where no kept ring holds the whole match, it is cut back to the longest prefix that one holds: a
kept ring in memory, or a persona's ring from disk (after a restart, the persona's whole-context
blocks come back from the disk tier, and its ring beside them)."""
import logging

from kvchat.engine.kv.manager import Sequence

log = logging.getLogger("kvchat.kv_pool")


class RingPrefix:
    def __init__(self, kvpool):
        self.kvpool = kvpool  # its rings, cache, manager and tiers are read live: a rebuild replaces them
        self.unsaved: list[tuple] = []  # persona rings kept since the last turn's end (``Rings.personas``' entries)

    def take(self, seq: Sequence, persona_len: int = 0) -> bool:
        """Give ``seq``'s cached prefix a kept ring that holds its window, the prefix cut back to
        the longest one a ring holds (``Rings.longest_held``, or its persona's, ``persona_len``
        tokens, on disk) where none holds it whole; False where none holds any of it."""
        pool = self.kvpool
        rings, copy = pool.rings, pool.kv.copy_ring
        if rings.take_over(seq, copy):
            return True
        held = rings.longest_held(seq.token_ids, seq.num_computed)
        held = max(held, self._from_disk(seq, held, persona_len))
        if not held:
            return False
        pool.manager.truncate(seq, held // pool.manager.block_size)
        return rings.take_over(seq, copy)

    def _from_disk(self, seq: Sequence, held: int, persona_len: int) -> int:
        """``seq``'s persona's ring from disk, where the match reaches past ``held`` tokens to the
        persona's last full block and the disk holds a ring kept there (one name looked up),
        loaded into free ring blocks as a persona's: its tokens, 0 where none is."""
        pool = self.kvpool
        rings = pool.rings
        blocks = pool.personas.num_blocks(seq, persona_len)
        n = blocks * pool.manager.block_size
        if not held < n <= seq.num_computed or len(seq.hashes) < blocks:
            return 0
        tensors = pool.tiers.stored_ring(seq.hashes[blocks - 1], seq.token_ids[:n])
        if tensors is None:
            return 0
        ring = rings.take_free(next(iter(tensors.values())).shape[1])  # [windowed layers, ring blocks, ...]
        if ring is None:
            return 0
        try:
            pool.kv.write_blocks(ring, tensors, sorted(pool.kv.local))
        except (ValueError, RuntimeError, MemoryError) as error:  # another layout (not expected), no memory
            rings.free[:0] = ring
            log.warning("could not restore a persona's ring from disk: %s", error)
            return 0
        rings.add_persona((seq.token_ids[:n], ring, (n - 1) // pool.manager.block_size))
        return n

    def persona_end(self, seq: Sequence, persona_len: int) -> int:
        """Where a windowed model's prompt stops a chunk so that ``persona_done`` copies the ring:
        its persona's last full block; 0 where no ring is kept (no rings, a persona under one
        block, or one whose persona ring is kept already: a chat's kept ring goes sooner)."""
        pool = self.kvpool
        if pool.rings is None:
            return 0
        end = pool.personas.num_blocks(seq, persona_len) * pool.manager.block_size
        return end if end and not pool.rings.keeps_persona(seq.token_ids, end) else 0

    def persona_done(self, seq: Sequence) -> None:
        """``seq`` computed its persona's full blocks: keep a copy of the ring there
        (``Rings.keep_persona``), so the next chat on the persona goes on from it; ``persist``
        writes it to disk."""
        pool = self.kvpool
        try:
            entry = pool.rings.keep_persona(seq, pool.kv.copy_ring)
        except (RuntimeError, MemoryError) as error:  # a copy for later: the reply goes on without it
            return log.warning("could not keep a copy of the persona's ring: %s", error)
        if entry is not None:
            self.unsaved.append(entry)

    def persist(self) -> None:
        """At a turn's end, beside its blocks: the persona rings kept since, still kept, to disk
        (pinned, as the persona's blocks are), for the next start's first chat on the persona."""
        pool, unsaved, self.unsaved = self.kvpool, self.unsaved, []
        for entry in unsaved:
            if pool.rings is None or not any(kept is entry for kept in pool.rings.personas):
                continue  # gone since (evicted, a rebuild): its rows are not these any more
            tokens, ring, _ = entry
            # named as the pool names the persona's last block now (a downshift since re-keys it)
            *_, (_, hash_) = pool.manager.chain(tokens, len(tokens) // pool.manager.block_size)
            try:
                pool.tiers.persist_ring(hash_, tokens, lambda: pool.kv.read_blocks(ring, sorted(pool.kv.local)))
            except (RuntimeError, MemoryError) as error:
                log.warning("could not write the persona's ring to disk: %s", error)

    def prompt_done(self, seq: Sequence) -> None:
        """``seq``'s prompt is computed, its reply not begun: keep a copy of the ring as it is
        (``Rings.snapshot``), so a regenerate goes on from it."""
        pool = self.kvpool
        if pool.rings is None:
            return
        try:
            pool.rings.snapshot(seq, pool.kv.copy_ring)
        except (RuntimeError, MemoryError) as error:  # a copy for later: the reply goes on without it
            log.warning("could not keep a copy of the prompt's ring: %s", error)
