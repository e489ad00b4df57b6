"""Persona prefixes: pinned in the pool while in use, so that the chats sharing one never compute
it again. On disk a persona's blocks are the disk tier's, pinned there too (``KVTiers.persist``),
and a restart restores them as any cached prefix."""
from collections import OrderedDict

from kvchat.engine.kv.manager import KVCacheManager, Sequence


class PersonaCache:
    def __init__(self, manager: KVCacheManager, max_pinned: int = 4):
        self.manager, self.max_pinned = manager, max_pinned
        self.pinned: OrderedDict[bytes, list] = OrderedDict()  # persona key -> [(block, its hash)]

    def num_blocks(self, seq: Sequence, persona_len: int) -> int:
        """Full blocks of the persona, short of the last prompt token (which is always computed)."""
        return min(persona_len, len(seq) - 1) // self.manager.block_size

    def remember(self, seq: Sequence, persona_len: int) -> int:
        """Pin the persona's blocks (evicted last); returns how many, for the disk tier to pin too."""
        n = self.num_blocks(seq, persona_len)
        if n == 0 or len(seq.hashes) < n:
            return 0
        self._pin(seq.hashes[n - 1], seq.blocks[:n], seq.hashes[:n])
        return n

    def _pin(self, key: bytes, blocks, hashes) -> None:
        pool = self.manager.pool
        self.pinned.pop(key, None)
        self.pinned[key] = list(zip(blocks, hashes))
        for block in blocks:
            pool.set_pinned(block, True)
        while len(self.pinned) > self.max_pinned:
            _, old = self.pinned.popitem(last=False)
            for block, h in old:
                if block.hash == h and not any(block is b for entry in self.pinned.values() for b, _ in entry):
                    pool.set_pinned(block, False)
