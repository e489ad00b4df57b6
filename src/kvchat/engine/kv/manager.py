"""Per-sequence block tables on top of the block pool: prefix matching, growth, caching, release."""
from dataclasses import dataclass, field

from kvchat.engine.kv.recent_window import RecentWindow

from kvchat.engine.kv.block_pool import Block, BlockPool, PoolExhausted, block_hash


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    blocks: list[Block] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # one per full block, chained
    num_computed: int = 0  # tokens whose K/V are in the pool
    window: RecentWindow | None = None  # made by the runner in the quantized modes
    ring: list[int] = field(default_factory=list)  # the windowed layers' ring blocks (``rings.Rings``)
    ring_clean: bool = True  # False while a step runs, or a match is checked: its rows may not be whole
    ring_top: int = -1  # the newest block whose rows its ring ever held (an earlier holder's, maybe)
    matching: bool = False  # its cached prefix is being found: blocks get no ring (``Rings.take_over`` gives it)

    def __len__(self) -> int:
        return len(self.token_ids)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, extra_key: str, rings=None):
        self.pool, self.block_size, self.extra_key = pool, block_size, extra_key
        self.rings = rings  # the windowed layers' rings, where the pool keeps them so
        self._last: tuple[list[int], RecentWindow] | None = None  # the last freed sequence's computed tokens, window

    def chain(self, token_ids: list[int], num_blocks: int):
        """``(chunk, hash)`` of the first full blocks, each hash chaining the one before."""
        bs, parent = self.block_size, None
        for i in range(num_blocks):
            chunk = token_ids[i * bs:(i + 1) * bs]
            parent = block_hash(parent, chunk, self.extra_key)
            yield chunk, parent

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
        """Attach the longest cached run of full blocks; the last token is always left to compute,
        since its logits are needed. Returns the number of tokens served from the cache."""
        assert not seq.blocks, "match_prefix runs once, on a fresh sequence"
        for chunk, h in self.chain(seq.token_ids, (len(seq) - 1) // self.block_size):
            block = self.pool.lookup(h, chunk)
            if block is None:
                break
            self.pool.touch(block)
            seq.blocks.append(block)
            seq.hashes.append(h)
        seq.num_computed = len(seq.blocks) * self.block_size
        return seq.num_computed

    def match_tail(self, seq: Sequence, copy=None) -> int:
        """After the full blocks (``match_prefix``, a restored persona): the rows of a cached block
        after the same prefix, up to the first token that differs. A partly filled block that an
        earlier sequence left (``free(keep_tail=True)``) is taken as it is; a full one (the last
        message edited) is copied first, ``copy(from id, to id)``, as others may use it. A chat's
        next turn then computes only its new tokens, not again the up to ``block_size - 1`` it
        shares with the blocks before, each of which attends to the whole context. In the
        quantized modes the last sequence's full-precision window goes on with this one, so its
        newest tokens are not read back quantized. Returns the tokens served."""
        served = self._match_block_tail(seq, copy)
        self._hand_window(seq)
        return served

    def _hand_window(self, seq: Sequence) -> None:
        last, self._last = self._last, None
        if last is None or seq.window is not None:
            return
        tokens, window = last
        n = seq.num_computed
        if 0 < n <= len(tokens) and tokens[:n] == seq.token_ids[:n] and window.current:
            window.rewind(n)
            window.released = False
            seq.window = window

    def _match_block_tail(self, seq: Sequence, copy) -> int:
        bs, i = self.block_size, len(seq.blocks)
        if not seq.hashes or len(seq.hashes) != i or seq.num_computed != i * bs:
            return 0
        wanted = seq.token_ids[i * bs:len(seq) - 1]  # the last token is always computed
        candidates = self.pool.children(seq.hashes[-1])
        same, block = max(((shared_prefix(b.token_ids, wanted), b) for b in candidates),
                          key=lambda c: (c[0], _partial(c[1], bs)), default=(0, None))
        if not same:
            for tail in candidates:  # the last turn's tail, of no use now: let the sequence grow into it
                if _partial(tail, bs):
                    self.pool.claim(tail)
                    self.pool.release([tail])
            return 0
        if _partial(block, bs):
            self.pool.claim(block)  # its rows from ``same`` on are about to be overwritten
            seq.blocks.append(block)
        elif copy is not None and self.pool.num_free > 1:
            self.pool.touch(block)  # not the block the allocation evicts
            try:
                seq.blocks.append(self.pool.allocate(prefer=seq.blocks[-1].id + 1))
            finally:
                self.pool.release([block])
            copy(block.id, seq.blocks[-1].id)
        else:
            return 0
        seq.num_computed += same
        return same

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` full blocks of a matched prefix; the rest go back
        (cached, for others), and a handed window with them."""
        self.pool.release(seq.blocks[num_blocks:])
        del seq.blocks[num_blocks:], seq.hashes[num_blocks:]
        seq.num_computed = num_blocks * self.block_size
        if seq.window is not None:
            seq.window.released, seq.window = True, None

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table to hold ``num_tokens``; raises PoolExhausted with nothing leaked
        (blocks already taken stay on the sequence and go back on free)."""
        needed = self.blocks_needed(num_tokens)
        missing = needed - len(seq.blocks)
        if missing > self.pool.num_free:
            raise PoolExhausted(f"KV cache is full: {missing} more blocks needed, {self.pool.num_free} free")
        rings = self.rings if not seq.matching else None
        if rings is not None:
            rings.check(seq, needed)
        first = len(seq.blocks)
        for _ in range(missing):
            seq.blocks.append(self.pool.allocate(prefer=seq.blocks[-1].id + 1 if seq.blocks else None))
        if rings is not None and missing > 0:
            rings.extend(seq, first)

    def shrink(self, seq: Sequence) -> None:
        """Blocks past the sequence's tokens go back: a speculative check reserved them for tokens
        it did not keep. Never a published block, nor a windowed model's (its rings follow them)."""
        keep = max(self.blocks_needed(len(seq)), len(seq.hashes))
        if self.rings is None and len(seq.blocks) > keep:
            self.pool.release(seq.blocks[keep:])
            del seq.blocks[keep:]

    def commit(self, seq: Sequence) -> None:
        """Publish every block that the computed tokens have filled, so later requests find it."""
        bs = self.block_size
        for i in range(len(seq.hashes), seq.num_computed // bs):
            chunk = seq.token_ids[i * bs:(i + 1) * bs]
            parent = seq.hashes[-1] if seq.hashes else None
            h = block_hash(parent, chunk, self.extra_key)
            self.pool.cache(seq.blocks[i], h, chunk, parent)
            seq.hashes.append(h)

    def relayout(self, extra_key: str, live: list[Sequence]) -> None:
        """The pool's bytes changed layout: re-key the cache, and the hash chains of live sequences."""
        self.extra_key = extra_key
        self.pool.rehash(extra_key)
        self._last = None  # a window in the old layout
        for seq in live:
            seq.hashes = [h for _, h in self.chain(seq.token_ids, len(seq.hashes))]

    def free(self, seq: Sequence, keep_tail: bool = False) -> None:
        """Release the sequence's blocks; with ``keep_tail``, the computed rows of its partly
        filled last block stay findable by ``match_tail`` until the block is evicted."""
        if seq.window is not None:
            seq.window.released = True  # its rows may go to the next sequence
        if keep_tail:
            self._keep_tail(seq)
            self._last = (seq.token_ids[:seq.num_computed], seq.window) if seq.window is not None else None
        if self.rings is not None:
            self.rings.release(seq, keep_tail)
        self.pool.release(seq.blocks)
        seq.blocks, seq.window = [], None

    def _keep_tail(self, seq: Sequence) -> None:
        bs = self.block_size
        i, filled = divmod(seq.num_computed, bs)
        if not filled or not 0 < i < len(seq.blocks) or len(seq.hashes) != i or seq.blocks[i].ref_cnt != 1:
            return
        parent, tokens = seq.hashes[-1], seq.token_ids[i * bs:i * bs + filled]
        h = block_hash(parent, tokens, self.extra_key)
        self.pool.cache(seq.blocks[i], h, tokens, parent)

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.blocks[position // self.block_size].id * self.block_size + position % self.block_size


def shared_prefix(cached, wanted) -> int:
    """How many first tokens ``cached`` and ``wanted`` have alike."""
    n = 0
    while n < min(len(cached), len(wanted)) and cached[n] == wanted[n]:
        n += 1
    return n


def _partial(block: Block, block_size: int) -> bool:
    """A sequence's released last block (``_keep_tail``), no one else's."""
    return block.ref_cnt == 0 and len(block.token_ids) < block_size


__all__ = ["KVCacheManager", "Sequence", "PoolExhausted"]
