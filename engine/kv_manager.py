"""Per-sequence block tables on top of the block pool: prefix matching, growth, caching, release."""
from dataclasses import dataclass, field

from kvchat.kernels.quant import RecentWindow

from .block_pool import Block, BlockPool, PoolExhausted, block_hash


@dataclass(eq=False)
class Sequence:
    token_ids: list[int]
    blocks: list[Block] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # one per full block, chained
    num_computed: int = 0  # tokens whose K/V are in the pool
    window: RecentWindow | None = None  # made by the runner in the quantized modes

    def __len__(self) -> int:
        return len(self.token_ids)


class KVCacheManager:
    def __init__(self, pool: BlockPool, block_size: int, extra_key: str):
        self.pool, self.block_size, self.extra_key = pool, block_size, extra_key

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

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Grow the block table to hold ``num_tokens``; raises PoolExhausted with nothing leaked
        (blocks already taken stay on the sequence and go back on free)."""
        missing = self.blocks_needed(num_tokens) - len(seq.blocks)
        if missing > self.pool.num_free:
            raise PoolExhausted(f"KV cache is full: {missing} more blocks needed, {self.pool.num_free} free")
        for _ in range(missing):
            seq.blocks.append(self.pool.allocate(prefer=seq.blocks[-1].id + 1 if seq.blocks else None))

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
        for seq in live:
            seq.hashes = [h for _, h in self.chain(seq.token_ids, len(seq.hashes))]

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks, seq.window = [], None

    def slot(self, seq: Sequence, position: int) -> int:
        return seq.blocks[position // self.block_size].id * self.block_size + position % self.block_size


__all__ = ["KVCacheManager", "Sequence", "PoolExhausted"]
