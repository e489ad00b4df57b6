"""The windowed layers' K/V: one ring of blocks per sequence, reused as the sequence moves on.

A windowed layer's query at position p reads positions ``p - W + 1 .. p`` only. So a sequence's
rows for those layers need ``ring`` blocks (``kv_sizes.ring_blocks``: W - 1 earlier positions and
the newest, wherever a block boundary falls), and its i-th block's rows go to ring block
``i % ring``: a block whose positions all fell out of the window is overwritten by a newer one,
and the memory of a long chat stops growing at the window. The whole-context layers keep their
rows in the block pool as before; the cache's ``block_map`` sends each block id to its ring block,
so the step's one block table serves both (the windowed layers read it through the map).

The prefix cache: a cached prefix of n tokens serves a windowed layer only if positions
``n - W + 1 .. n`` are still in a ring. An ended sequence's ring is kept with its tokens, until
a running request needs its blocks (the oldest kept goes first), for the next request that shares
those tokens (its chat's next turn), which takes it over. Another request that finds cached
blocks but no ring holding their window computes its prompt again (vLLM v1's ``SlidingWindowManager`` keeps the window's
blocks cached instead; here the rings are what makes the memory small, so they are not shared).
"""
from kvchat.core.kv_sizes import KVShape, ring_blocks
from kvchat.engine.kv.block_pool import PoolExhausted


class RingsExhausted(PoolExhausted):
    """Every ring block is held: a request waits for a ring (a lower precision would not help)."""


class Rings:
    def __init__(self, shape: KVShape, block_size: int, num_blocks: int, place):
        self.size, self.block_size = ring_blocks(shape, block_size), block_size
        self.window = max(w for w in shape.windows if w)
        self.free = list(range(num_blocks))
        # ended sequences' computed tokens, rings and ring tops (``Sequence.ring_top``), oldest first
        self.kept: list[tuple[list[int], list[int], int]] = []
        self.copied: list[int] | None = None  # the ring of the newest ``snapshot``
        self._place = place  # place(block ids, ring block ids): the cache's block_map

    def missing(self, seq, num_blocks: int) -> int:
        """Ring blocks ``seq`` still needs to hold ``num_blocks`` blocks."""
        return max(0, min(num_blocks, self.size) - len(seq.ring))

    def available(self) -> int:
        return len(self.free) + self.kept_blocks()

    def kept_blocks(self) -> int:
        return sum(len(ring) for _, ring, _ in self.kept)

    def check(self, seq, num_blocks: int) -> None:
        if self.missing(seq, num_blocks) > self.available():
            raise RingsExhausted("the windowed layers' rings are all in use")

    def extend(self, seq, first: int) -> None:
        """Give ``seq.blocks[first:]`` their ring blocks (``check`` passed), growing the ring
        until it is whole."""
        while len(seq.ring) < min(len(seq.blocks), self.size):
            if not self.free:  # the oldest kept ring goes first
                self.free.extend(self.kept.pop(0)[1])
            seq.ring.append(self.free.pop(0))
        ids = list(range(first, len(seq.blocks)))
        self._place([seq.blocks[i].id for i in ids], [seq.ring[i % self.size] for i in ids])

    def release(self, seq, keep: bool) -> None:
        """``seq`` ended; with ``keep``, its ring stays for the next request, unless a step that
        failed part way may have overwritten rows its window still reads (``seq.ring_clean``)."""
        ring, seq.ring = seq.ring, []
        top, seq.ring_top = max(seq.ring_top, (seq.num_computed - 1) // self.block_size), -1
        if keep and ring and seq.num_computed and seq.ring_clean:
            self.kept.append((seq.token_ids[:seq.num_computed], ring, top))
        else:
            self.free.extend(ring)

    def snapshot(self, seq, copy) -> None:
        """Keep a copy of ``seq``'s ring as its prompt left it, for a regenerate of that prompt
        (the reply overwrites the ring itself). Only into free blocks, never a kept ring's: a
        chat's next turn is worth more. Kept as the oldest, so the first to go; one at a time.
        ``copy(from ring blocks, to ring blocks)`` copies the windowed layers' rows."""
        n = seq.num_computed
        for i, (_, ring, _) in enumerate(self.kept):
            if ring is self.copied:  # the last copy, unless it went already
                self.free.extend(self.kept.pop(i)[1])
                break
        self.copied = None
        if not seq.ring or not seq.ring_clean or len(seq.ring) > len(self.free):
            return
        ring = self.free[:len(seq.ring)]
        copy(seq.ring, ring)  # first: a copy that fails leaves the blocks free
        del self.free[:len(ring)]
        self.kept.insert(0, (seq.token_ids[:n], ring, max(seq.ring_top, (n - 1) // self.block_size)))
        self.copied = ring

    def take_over(self, seq) -> bool:
        """Give ``seq``, which found ``seq.num_computed`` tokens cached, a kept ring that holds
        their window (the newest that does); False when none does (the caller drops the cached
        prefix)."""
        n, bs = seq.num_computed, self.block_size
        first = max(0, n - self.window + 1) // bs
        window_blocks = seq.blocks[first:-(-n // bs)]
        if any(b.ref_cnt != 1 for b in window_blocks):  # a running sequence reads these rows
            return False
        i = self.holding(seq.token_ids, n)
        if i is None:
            return False
        held = len(self.kept[i][1])
        if min(len(seq.blocks), self.size) - held > self.available() - held + len(seq.ring):
            return False  # the ring could not grow to the sequence's blocks: the others hold them
        _, ring, top = self.kept.pop(i)
        self.copied = None if ring is self.copied else self.copied  # a running sequence's ring now
        self.free.extend(seq.ring)  # none, unless a caller reserved rings for it
        seq.ring, seq.ring_top = ring, top
        self.extend(seq, first)  # its blocks from the window on, a restore's reserved ones too
        return True

    def holding(self, token_ids: list[int], n: int) -> int | None:
        """The newest kept ring that holds the window of ``token_ids[:n]`` (its index), or None."""
        for i in range(len(self.kept) - 1, -1, -1):
            tokens, _, top = self.kept[i]
            # blocks before the window of the newest block written are overwritten: a ring taken
            # over from a longer sequence holds that one's newer blocks past its own tokens
            held_from = max(0, (top - self.size + 1) * self.block_size)
            if n <= len(tokens) and held_from <= max(0, n - self.window + 1) and tokens[:n] == token_ids[:n]:
                return i
        return None

    def forget(self) -> None:
        """Drop the kept rings (a deleted chat's rows may be among them)."""
        for _, ring, _ in self.kept:
            self.free.extend(ring)
        self.kept, self.copied = [], None
