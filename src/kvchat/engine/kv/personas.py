"""Persona prefixes: pinned in the pool while in use, persisted to disk, restored on a miss."""
import logging
from collections import OrderedDict

from kvchat.kernels.quant import SINKS

from kvchat.engine.kv.cache import KVCache
from kvchat.engine.kv.manager import KVCacheManager, Sequence
from kvchat.engine.kv.persona_store import PersonaStore

log = logging.getLogger("kvchat.personas")
SINK_NAMES = ("sink_k", "sink_v")  # in a persona file: the sink rows of a quantized pool


class PersonaCache:
    def __init__(self, manager: KVCacheManager, kv: KVCache, store: PersonaStore | None, max_pinned: int = 4):
        self.manager, self.kv, self.store, self.max_pinned = manager, kv, store, max_pinned
        self.pinned: OrderedDict[bytes, list] = OrderedDict()  # persona key -> [(block, its hash)]

    def num_blocks(self, seq: Sequence, persona_len: int) -> int:
        """Full blocks of the persona, short of the last prompt token (which is always computed)."""
        return min(persona_len, len(seq) - 1) // self.manager.block_size

    def key(self, seq: Sequence, n: int) -> bytes:
        """The persona's name on disk: the chained hash of its last full block."""
        return list(self.manager.chain(seq.token_ids, n))[-1][1]

    def restore(self, seq: Sequence, persona_len: int) -> int:
        """After the pool's own prefix match: fill the rest of the persona from disk. Returns the
        tokens restored."""
        n, bs = self.num_blocks(seq, persona_len), self.manager.block_size
        have = len(seq.blocks)
        if self.store is None or n <= have:
            return 0
        tokens = seq.token_ids[:n * bs]
        tensors = self.store.load(self.key(seq, n), self.manager.extra_key, tokens)
        if tensors is None:
            return 0
        sinks = [tensors.pop(name, None) for name in SINK_NAMES]
        self.manager.reserve(seq, n * bs)
        try:
            self.kv.write_blocks([b.id for b in seq.blocks[have:n]], {k: v[:, have:n] for k, v in tensors.items()})
        except ValueError as e:
            log.warning("persona cache file does not fit this pool: %s", e)
            return 0
        if None not in sinks:
            self.kv.keep_sinks(tokens, *sinks)
        seq.num_computed = n * bs
        self.manager.commit(seq)
        return (n - have) * bs

    def remember(self, seq: Sequence, persona_len: int) -> None:
        """Pin the persona's blocks (evicted last) and write them to disk once."""
        n = self.num_blocks(seq, persona_len)
        if n == 0 or len(seq.hashes) < n:
            return
        key = seq.hashes[n - 1]
        self._pin(key, seq.blocks[:n], seq.hashes[:n])
        if self.store is not None and not self.store.has(key):
            tensors = self.kv.read_blocks([b.id for b in seq.blocks[:n]])
            sinks = self.kv.sink_cache.get(tuple(seq.token_ids[:SINKS]))
            if sinks is not None:  # a quantized pool: the first tokens in full precision, exact after a restart
                tensors.update({name: t.cpu() for name, t in zip(SINK_NAMES, sinks)})
            try:
                self.store.save(key, self.manager.extra_key, seq.token_ids[:n * self.manager.block_size], tensors)
            except OSError as e:
                log.warning("could not write the persona cache: %s", e)

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
