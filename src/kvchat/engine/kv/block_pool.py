"""Blocks, ref counts, the LRU free queue and the hash -> block map that makes the prefix cache.

A free block keeps its hash and stays findable until it is evicted to serve an allocation.
Eviction takes the front of the free queue; pinned blocks (persona prefixes) sit in their own
queue and go only when no unpinned free block is left.
"""
import hashlib
from collections import OrderedDict
from dataclasses import dataclass


class PoolExhausted(RuntimeError):
    pass


def block_hash(parent: bytes | None, token_ids, extra_key: str) -> bytes:
    """Names a whole prefix: the parent's hash chains every earlier block in."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"root")
    h.update(extra_key.encode())
    h.update(b"".join(int(t).to_bytes(4, "little") for t in token_ids))
    return h.digest()


@dataclass(eq=False)
class Block:
    id: int
    ref_cnt: int = 0
    hash: bytes | None = None
    token_ids: tuple = ()
    pinned: bool = False
    parent: bytes | None = None  # the previous block's hash: lets a layout change rehash the chain


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError("a block pool needs at least one block")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, Block] = OrderedDict((b.id, b) for b in self.blocks)
        self.pinned_queue: OrderedDict[int, Block] = OrderedDict()
        self.cached: dict[bytes, Block] = {}
        self.evictions = 0
        self.on_evict = None  # called with a cached block about to be reused: the lower tiers keep its bytes

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free_queue) + len(self.pinned_queue)

    @property
    def num_reclaimable(self) -> int:
        """Free blocks that still hold a cached prefix."""
        return sum(1 for q in (self.free_queue, self.pinned_queue) for b in q.values() if b.hash)

    def allocate(self, prefer: int | None = None) -> Block:
        """The front of the free queue; or block ``prefer`` when it is free and holds no cached
        prefix: a sequence that grows into the id after its last block keeps its K/V one run of
        consecutive blocks, which attention reads in place instead of gathering a copy of the
        whole context every prefill chunk."""
        block = self._empty(prefer)
        if block is not None:
            del self.free_queue[block.id]
        else:
            queue = self.free_queue or self.pinned_queue
            if not queue:
                raise PoolExhausted("KV cache is full")
            _, block = queue.popitem(last=False)
            if block.hash is not None and self.on_evict is not None:
                self.on_evict(block)
            self._forget(block)
        block.ref_cnt = 1
        return block

    def _empty(self, block_id: int | None) -> Block | None:
        if block_id is None or not 0 <= block_id < self.num_blocks:
            return None
        block = self.blocks[block_id]
        return block if block.hash is None and block.id in self.free_queue else None

    def lookup(self, hash_: bytes, token_ids) -> Block | None:
        block = self.cached.get(hash_)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def children(self, parent: bytes) -> list[Block]:
        """The cached blocks that follow the block named ``parent``: a scan, run once a request."""
        return [b for b in self.cached.values() if b.parent == parent]

    def touch(self, block: Block) -> None:
        """Take a reference to a cached block, pulling it out of a free queue if it sat there."""
        if block.ref_cnt == 0:
            self.free_queue.pop(block.id, None)
            self.pinned_queue.pop(block.id, None)
        block.ref_cnt += 1

    def claim(self, block: Block) -> None:
        """Take a free cached block to write into: it leaves the cache, as its rows will change
        (not an eviction: nothing is lost that the taker does not keep)."""
        self.touch(block)
        if self.cached.get(block.hash) is block:
            del self.cached[block.hash]
        block.hash, block.token_ids, block.pinned, block.parent = None, (), False, None

    def release(self, blocks: list[Block]) -> None:
        """Drop one reference from each; the tail goes first into the queue so it is evicted first."""
        for block in reversed(blocks):
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (self.pinned_queue if block.pinned else self.free_queue)[block.id] = block

    def cache(self, block: Block, hash_: bytes, token_ids, parent: bytes | None = None) -> None:
        if block.hash is not None:
            return
        if hash_ in self.cached:  # the same prefix computed twice: keep the older copy findable
            return
        block.hash, block.token_ids, block.parent = hash_, tuple(token_ids), parent
        self.cached[hash_] = block

    def drop(self, blocks) -> int:
        """Forget these blocks' cached prefixes (a deleted chat's), unless a sequence holds them or
        they are pinned (a persona's); nothing goes to a lower tier. Returns how many."""
        n = 0
        for block in blocks:
            if block.ref_cnt == 0 and block.hash is not None and not block.pinned:
                self._forget(block)
                n += 1
        return n

    def grow(self, num_blocks: int) -> None:
        """Add blocks up to ``num_blocks`` (a layout change fitted more into the same bytes)."""
        for i in range(self.num_blocks, num_blocks):
            block = Block(i)
            self.blocks.append(block)
            self.free_queue[i] = block
            self.free_queue.move_to_end(i, last=False)  # empty blocks go before cached ones

    def clear_cache(self) -> None:
        """Forget every cached prefix that no sequence holds."""
        for queue in (self.free_queue, self.pinned_queue):
            for block in queue.values():
                self._forget(block)
        self.free_queue.update(self.pinned_queue)
        self.pinned_queue.clear()

    def shrink(self, num_blocks: int) -> bool:
        """Drop the blocks with ids >= ``num_blocks``; False (and nothing done) if one is in use."""
        tail = self.blocks[num_blocks:]
        if any(b.ref_cnt for b in tail):
            return False
        for block in tail:
            self.free_queue.pop(block.id, None)
            self.pinned_queue.pop(block.id, None)
            self._forget(block)
        del self.blocks[num_blocks:]
        return True

    def compact(self, num_blocks: int) -> dict[int, int] | None:
        """Give every in-use block with an id >= ``num_blocks`` a free id below it, so a shrink can
        go ahead: the two blocks swap ids, the free one's cached prefix is forgotten (LRU first).
        Returns ``{old id: new id}`` for the caller to move the data; None (and nothing done) when
        too few low ids are free."""
        movers = [b for b in self.blocks[num_blocks:] if b.ref_cnt]
        spots = [b for q in (self.free_queue, self.pinned_queue) for b in q.values() if b.id < num_blocks]
        if len(spots) < len(movers):
            return None
        moves = {}
        for block, spot in zip(movers, spots):
            (self.pinned_queue if spot.id in self.pinned_queue else self.free_queue).pop(spot.id)
            self._forget(spot)
            moves[block.id] = spot.id
            block.id, spot.id = spot.id, block.id
            self.blocks[block.id], self.blocks[spot.id] = block, spot
            self.free_queue[spot.id] = spot
        return moves

    def rehash(self, extra_key: str) -> dict[bytes, bytes]:
        """Re-key every cached block for a new layout, parents first; a block whose parent is gone
        can never be reached again and is dropped from the map. Returns old -> new hashes."""
        renamed: dict[bytes, bytes] = {}
        pending = list(self.cached.values())
        self.cached = {}
        while pending:
            waiting = []
            for block in pending:
                if block.parent is not None and block.parent not in renamed:
                    waiting.append(block)
                    continue
                new = block_hash(renamed.get(block.parent), block.token_ids, extra_key)
                renamed[block.hash] = new
                block.hash, block.parent = new, renamed.get(block.parent)
                self.cached[new] = block
            if len(waiting) == len(pending):
                for block in waiting:  # orphans
                    block.hash, block.token_ids, block.parent = None, (), None
                break
            pending = waiting
        return renamed

    def set_pinned(self, block: Block, pinned: bool) -> None:
        if block.pinned == pinned:
            return
        block.pinned = pinned
        if block.ref_cnt == 0:
            src, dst = (self.free_queue, self.pinned_queue) if pinned else (self.pinned_queue, self.free_queue)
            src.pop(block.id, None)
            dst[block.id] = block

    def _forget(self, block: Block) -> None:
        if block.hash is not None:
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
            self.evictions += 1
        block.hash, block.token_ids, block.pinned, block.parent = None, (), False, None
