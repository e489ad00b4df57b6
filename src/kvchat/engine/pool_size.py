"""How big a loaded model's KV pool is, and at which precision it starts, for a config: the
context capped at what the model was trained for, the bytes a full context needs at Auto's first
rung, what memory is free beside the weights and the activations. Asked when a model loads and
when the settings change."""
from dataclasses import replace

from kvchat.core.config import ConfigError, EngineConfig, Precision
from kvchat.core.kv_sizes import KVShape, config_value, local_blocks_for, pool_blocks, pool_bytes, quantizable
from kvchat.core.memory import pool_span
from kvchat.core.memory_policy import MemoryPolicy
from kvchat.engine.kv.pool import kv_dtype


class PoolSize:
    def __init__(self, loaded, probe, activations: int, notice):
        self.loaded, self.probe, self.activations, self.notice = loaded, probe, activations, notice
        self.shape = KVShape.from_config(loaded.model.config)

    def capped(self, cfg: EngineConfig) -> EngineConfig:
        """The context is capped at what the model was trained for, unless the config allows more."""
        trained = config_value(self.loaded.model.config, "max_position_embeddings")
        if not trained or cfg.max_context <= trained:
            return cfg
        if cfg.allow_long_context:
            self.notice("context", f"{cfg.max_context:,} tokens is longer than the {trained:,} "
                                   "the model was trained for: expect worse answers past that")
            return cfg
        self.notice("context", f"{cfg.max_context:,} tokens capped at {trained:,}, the length the model "
                               "was trained for")
        return replace(cfg, max_context=trained)

    def layout(self, cfg: EngineConfig) -> tuple[Precision, int]:
        """The pool's precision and bytes, sized from the context (never from all that is free).
        Auto starts at fp16, the best quality, in at most the bytes a full fp16 context needs, and
        steps down when the conversation outgrows them or memory runs short."""
        policy = self.policy(cfg)
        if cfg.kv_budget_bytes is not None:
            return policy.rungs()[0], cfg.kv_budget_bytes
        total, used = self.probe.totals()
        available = total - used - self.activations - cfg.headroom_bytes
        if available <= 0:
            raise ConfigError("not enough free memory for a KV cache; lower the context or free memory")
        want = self.kv_bytes(cfg, policy.rungs()[0])
        lowest = policy.lowest()
        need = self.kv_bytes(cfg, lowest)
        if need > available:
            raise ConfigError(f"a context of {cfg.max_context:,} tokens needs {need / 2**20:,.0f} MiB of KV cache at "
                              f"{lowest.value}; {available / 2**20:,.0f} MiB are free: lower the context"
                              + ("" if lowest == Precision.INT4 else " or the precision"))
        budget = min(want, available)
        local, full = self.ring_blocks(cfg), kv_dtype(self.loaded).itemsize
        # Auto: where the rings alone fill the budget at fp16, a lower rung leaves blocks beside them
        holds = lambda p: pool_blocks(self.shape, p, cfg.block_size, budget, full, local, self.span(cfg))[0] >= 1
        return policy.start(holds), budget

    def policy(self, cfg: EngineConfig) -> MemoryPolicy:
        return MemoryPolicy(cfg.kv_precision, quantizable(self.shape))

    def ring_blocks(self, cfg: EngineConfig) -> int | None:
        """The windowed layers' ring blocks for ``cfg``'s context (kv/rings.py), where they take
        less than whole blocks; a budget given in bytes decides them itself (None)."""
        if cfg.kv_budget_bytes is not None:
            return None
        return local_blocks_for(self.shape, cfg.block_size, self.span(cfg))

    @staticmethod
    def span(cfg: EngineConfig) -> int:
        return pool_span(cfg.max_context)

    def kv_bytes(self, cfg: EngineConfig, precision: Precision) -> int:
        """What a pool for ``cfg``'s context plus the prefix-cache reserve takes."""
        return pool_bytes(self.shape, precision, self.span(cfg), kv_dtype(self.loaded).itemsize, cfg.block_size) + 1
