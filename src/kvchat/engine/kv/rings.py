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
those tokens (its chat's next turn), which takes it over. A persona's ring, as its prompt left it
at the persona's last full block, is kept apart and copied (taken over only where no blocks are
left for a copy): every new chat on that persona starts from it, and kept rings go before it. A request whose cached blocks no ring
holds the window of goes back to the longest prefix that a kept ring does hold (an edited message
to the persona's end), and computes the rest (vLLM v1's ``SlidingWindowManager`` keeps the
window's blocks cached instead; here the rings are what makes the memory small, so they are not
shared).
"""
from kvchat.core.kv_sizes import KVShape, ring_blocks
from kvchat.engine.kv.block_pool import PoolExhausted
from kvchat.engine.kv.manager import shared_prefix

MAX_PERSONAS = 4  # persona rings kept, as ``PersonaCache`` pins four personas' blocks


class RingsExhausted(PoolExhausted):
    """Every ring block is held: a request waits for a ring (a lower precision would not help)."""


class Rings:
    def __init__(self, shape: KVShape, block_size: int, num_blocks: int, place):
        self.size, self.block_size = ring_blocks(shape, block_size), block_size
        self.window = max(w for w in shape.windows if w)
        self.free = list(range(num_blocks))
        # ended sequences' computed tokens, rings and ring tops (``Sequence.ring_top``), oldest first
        self.kept: list[tuple[list[int], list[int], int]] = []
        self.personas: list[tuple[list[int], list[int], int]] = []  # the same, at personas' ends
        self.copied: list[int] | None = None  # the ring of the newest ``snapshot``
        self._place = place  # place(block ids, ring block ids): the cache's block_map

    def missing(self, seq, num_blocks: int) -> int:
        """Ring blocks ``seq`` still needs to hold ``num_blocks`` blocks."""
        return max(0, min(num_blocks, self.size) - len(seq.ring))

    def available(self) -> int:
        return len(self.free) + self.kept_blocks()

    def kept_blocks(self, personas: bool = True) -> int:
        return sum(len(ring) for _, ring, _ in self.kept + (self.personas if personas else []))

    def _pop_kept(self, i: int) -> list[int]:
        """The ring of ``kept[i]``, no longer kept (nor the newest snapshot's, if it was that)."""
        ring = self.kept.pop(i)[1]
        self.copied = None if ring is self.copied else self.copied
        return ring

    def check(self, seq, num_blocks: int) -> None:
        if self.missing(seq, num_blocks) > self.available():
            raise RingsExhausted("the windowed layers' rings are all in use")

    def extend(self, seq, first: int) -> None:
        """Give ``seq.blocks[first:]`` their ring blocks (``check`` passed), growing the ring
        until it is whole."""
        while len(seq.ring) < min(len(seq.blocks), self.size):
            if not self.free:  # the oldest kept ring goes first, a persona's last
                self.free.extend(self._pop_kept(0) if self.kept else self.personas.pop(0)[1])
            seq.ring.append(self.free.pop(0))
        ids = list(range(first, len(seq.blocks)))
        self._place([seq.blocks[i].id for i in ids], [seq.ring[i % self.size] for i in ids])

    def release(self, seq, keep: bool) -> None:
        """``seq`` ended; with ``keep``, its ring stays for the next request, unless a step that
        failed part way may have overwritten rows its window still reads (``seq.ring_clean``)."""
        ring, seq.ring = seq.ring, []
        top, seq.ring_top = max(seq.ring_top, (seq.num_computed - 1) // self.block_size), -1
        if not (keep and ring and seq.num_computed and seq.ring_clean):
            self.free.extend(ring)
            return
        tokens = seq.token_ids[:seq.num_computed]
        for i, (other, _, other_top) in enumerate(self.kept):
            if other_top == top and other == tokens:  # the prompt's copy of this very ring: a reply of one token
                self.free.extend(self._pop_kept(i))
                break
        self.kept.append((tokens, ring, top))

    def snapshot(self, seq, copy) -> None:
        """Keep a copy of ``seq``'s ring as its prompt left it, for a regenerate of that prompt
        (the reply overwrites the ring itself). Only into free blocks, never a kept ring's: a
        chat's next turn is worth more. Kept as the oldest, so the first to go; one at a time.
        ``copy(from ring blocks, to ring blocks)`` copies the windowed layers' rows."""
        for i, (_, ring, _) in enumerate(self.kept):
            if ring is self.copied:  # the last copy, unless it went already
                self.free.extend(self._pop_kept(i))
                break
        entry = self._copy(seq, copy)
        if entry is not None:
            self.kept.insert(0, entry)
            self.copied = entry[1]

    def keep_persona(self, seq, copy):
        """Keep a copy of ``seq``'s ring at the end of its persona (its computed tokens), for the
        next chats on it, unless one is kept already. Every new chat and edit on the persona
        starts there, so the oldest kept rings make room for it (a persona's never do). Returns
        the new entry, or None where none was kept."""
        if self.keeps_persona(seq.token_ids, seq.num_computed):
            return None
        # only the persona's own blocks: a ring taken over from a longer chat holds its rows past them
        entry = self._copy(seq, copy, evict=True, blocks=-(-seq.num_computed // self.block_size))
        if entry is not None:
            self.add_persona(entry)
        return entry

    def add_persona(self, entry: tuple[list[int], list[int], int]) -> None:
        """Keep ``(tokens, ring, top)`` as a persona's ring; the oldest goes past ``MAX_PERSONAS``."""
        self.personas.append(entry)
        while len(self.personas) > MAX_PERSONAS:
            self.free.extend(self.personas.pop(0)[1])

    def _copy(self, seq, copy, evict: bool = False, blocks: int | None = None):
        """``seq``'s computed tokens, a copy of its ring (its first ``blocks``), its top: in free
        blocks, or with ``evict`` in the oldest kept rings' too; None where the ring may not be
        whole or the blocks are too few."""
        source = seq.ring[:blocks]
        if not source or not seq.ring_clean or len(source) > len(self.free) and not evict:
            return None
        ring = self.take_free(len(source))
        if ring is None:
            return None
        self._copy_into(copy, source, ring)
        n = seq.num_computed
        return seq.token_ids[:n], ring, max(seq.ring_top, (n - 1) // self.block_size)

    def take_over(self, seq, copy) -> bool:
        """Give ``seq``, which found ``seq.num_computed`` tokens cached, a kept ring that holds
        their window (the newest that does; a persona's is copied, ``copy`` as in ``snapshot``);
        False when none does (the caller drops the cached prefix, or some of it)."""
        n, bs = seq.num_computed, self.block_size
        first = max(0, n - self.window + 1) // bs
        window_blocks = seq.blocks[first:-(-n // bs)]
        if any(b.ref_cnt != 1 for b in window_blocks):  # a running sequence reads these rows
            return False
        store, i = self.kept, self._holder(self.kept, seq.token_ids, n)
        if i is None:
            store, i = self.personas, self._holder(self.personas, seq.token_ids, n)
        if i is None:
            return False
        held = len(store[i][1])
        if min(len(seq.blocks), self.size) - held > self.available() - held + len(seq.ring):
            return False  # the ring could not grow to the sequence's blocks: the others hold them
        tokens, ring, top = store[i]
        fresh = self.take_free(len(ring)) if store is self.personas else None
        if fresh is None:  # taken over (a running sequence's ring now): a persona's too where no blocks are left for a copy
            if store is self.kept:
                self._pop_kept(i)
            else:
                store.pop(i)
        else:
            self._copy_into(copy, ring, fresh)
            store.append(store.pop(i))  # the persona used last goes last
            ring = fresh
        self.free.extend(seq.ring)  # none, unless a caller reserved rings for it
        seq.ring, seq.ring_top = ring, top
        self.extend(seq, first)  # its blocks from the window on, a restore's reserved ones too
        return True

    def take_free(self, k: int) -> list[int] | None:
        """``k`` free blocks, taken off the free list (the oldest kept rings go to it first, no
        persona's); None, and nothing evicted, where there are not so many."""
        if len(self.free) + self.kept_blocks(personas=False) < k:
            return None
        while len(self.free) < k:
            self.free.extend(self._pop_kept(0))
        taken = self.free[:k]
        del self.free[:k]
        return taken

    def _copy_into(self, copy, source: list[int], target: list[int]) -> None:
        """``copy(source, target)``; a copy that fails leaves ``target`` free."""
        try:
            copy(source, target)
        except BaseException:
            self.free[:0] = target
            raise

    def holding(self, token_ids: list[int], n: int) -> bool:
        """A kept ring (a persona's too) holds the window of ``token_ids[:n]``."""
        return any(self._holder(store, token_ids, n) is not None for store in (self.kept, self.personas))

    def keeps_persona(self, token_ids: list[int], n: int) -> bool:
        return self._holder(self.personas, token_ids, n) is not None

    def longest_held(self, token_ids: list[int], n: int) -> int:
        """The longest prefix of ``token_ids``, whole blocks and at most ``n`` tokens, whose window
        a kept ring holds (0 where none does)."""
        bs, best = self.block_size, 0
        for tokens, _, top in self.kept + self.personas:
            m = shared_prefix(tokens[:n], token_ids) // bs * bs
            if m > best and self._held_from(top) <= max(0, m - self.window + 1):
                best = m
        return best

    def _held_from(self, top: int) -> int:
        # blocks before the window of the newest block written are overwritten: a ring taken
        # over from a longer sequence holds that one's newer blocks past its own tokens
        return max(0, (top - self.size + 1) * self.block_size)

    def _holder(self, store, token_ids: list[int], n: int) -> int | None:
        """The newest ring in ``store`` that holds the window of ``token_ids[:n]`` (its index)."""
        for i in range(len(store) - 1, -1, -1):
            tokens, _, top = store[i]
            if n <= len(tokens) and self._held_from(top) <= max(0, n - self.window + 1) and tokens[:n] == token_ids[:n]:
                return i
        return None

    def forget(self, personas: bool = False) -> None:
        """Drop the kept rings (a deleted chat's rows may be among them); personas' stay, as
        their pinned blocks do, unless ``personas``."""
        for _, ring, _ in self.kept + (self.personas if personas else []):
            self.free.extend(ring)
        self.kept, self.copied = [], None
        if personas:
            self.personas = []
