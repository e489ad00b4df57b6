"""A loaded session: what a model load makes, in one object. The model, its chat formatter and
end tokens, the bytes its weights and activations take, the config it was loaded with (the
context capped), the memory policy for that config, the pool's sizing and the KV pool itself.

The engine holds one and swaps the reference whole: a load makes a new one, a settings change
another with the new config and policy around the same pool (rebuilt in place). The engine's parts
take it as an argument; none of them holds the engine."""
from dataclasses import asdict, dataclass

from kvchat.core.config import EngineConfig, Precision
from kvchat.core.memory_policy import MemoryPolicy
from kvchat.engine.chat import ChatFormatter
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.model.loading import LoadedModel
from kvchat.engine.pool_size import PoolSize


@dataclass
class Session:
    config: EngineConfig
    loaded: LoadedModel
    formatter: ChatFormatter
    eos_ids: frozenset[int]
    probe: object  # engine.memory_probe.MemoryProbe, or a test's
    weights_bytes: int
    activations: int
    size: PoolSize
    policy: MemoryPolicy
    kvpool: KVPool
    warmed: bool = False  # CUDA: the smallest decode graph captured for this pool

    @property
    def precision(self) -> Precision:
        return self.kvpool.precision

    def settings(self) -> dict:
        """The config as the GUI shows it, plain values only, with the pool's precision."""
        return {**config_settings(self.config), "precision": self.kvpool.precision.value}

    def context_limit(self) -> int:
        """Tokens a sequence may reach: the context setting, and what the pool holds at the lowest
        precision it may step down to."""
        return min(self.config.max_context, self.kvpool.tokens_for(self.policy.lowest()))


def config_settings(config: EngineConfig) -> dict:
    out = asdict(config)
    out["kv_precision"] = config.kv_precision.value
    return out
