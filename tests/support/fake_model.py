"""The fake backend's model and machine, torch-free: a word-level tokenizer and chat template, canned
replies, a prefix cache of 16-token blocks, personas' KV on a fake disk, and memory snapshots from the
planner (core.memory) on a fixed 24 GiB machine. Everything is a pure function of its input: the
same prompt gives the same reply, token ids and stats on every run."""
import random
import re
import threading
import zlib
from types import SimpleNamespace

from kvchat.core.config import BLOCK_SIZE, LADDER, Precision
from kvchat.core.kv_sizes import KVShape, bytes_per_token, config_value
from kvchat.core.memory import PREFIX_RESERVE, MemorySnapshot, activations_bytes, parameter_counts

# The starter as the engine loads it (its converted config.json, and what its generation config
# holds: no sampling defaults of its own, so the app's fallbacks apply).
STARTER_CONFIG = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                  "max_position_embeddings": 8192, "tie_word_embeddings": True}
STARTER_GENERATION = {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                      "use_cache": True}
STARTER_LABEL = "starter (SmolLM2-135M-Instruct)"
EOS = 2
MACHINE_RAM = 24 << 30  # the fake machine: a CPU with 24 GiB, 2 GiB of it taken by other programs
OTHER_PROGRAMS = 2 << 30
RUNTIME = 600 << 20  # the fake engine's own process besides weights and KV (Python, Qt, torch)
FULL_BYTES = 4  # the CPU keeps "fp16" K/V in fp32, as the engine does there

CANNED = (("capital of france", "The capital of France is Paris."),
          ("capital of italy", "The capital of Italy is Rome."),
          ("color", "Blue is the color of a clear sky."), ("fruit", "An apple is a sweet fruit."),
          ("2 + 2", "2 + 2 is 4."), ("3 + 3", "3 + 3 is 6."),
          ("prime", "A prime number has exactly two divisors: one and itself."),
          ("remember", "I will remember that."), ("hello", "Hello! How can I help you today?"),
          ("hi", "Hi! What would you like to talk about?"))
REPEATS = ("over and over", "again and again")  # a prompt that makes the model loop on " la"
STORY = ("once upon a time a small dragon lived in the hills above a quiet town and every morning it "
         "flew over the river to watch the boats while the baker sang and the children ran along the "
         "old stone bridge until the bells rang noon and the market closed its green doors for the day "
         "then clouds came from the sea with rain wind thunder and bright silver light").split()


def pieces(text: str) -> list[str]:
    """One token per word, its leading space or newline included."""
    return re.findall(r"\s*\S+|\s+$", text)


def token_id(piece: str) -> int:
    return 3 + zlib.crc32(piece.encode()) % (STARTER_CONFIG["vocab_size"] - 3)


def namespace(config: dict) -> SimpleNamespace:
    """A config as transformers gives it (attributes), with the parameter count the engine adds."""
    out = SimpleNamespace(**config)
    try:
        out.kvchat_parameter_count = sum(parameter_counts(config))
    except (TypeError, KeyError):
        pass
    return out


class FakeModel:
    """What one load gives: the model's config, name and generation defaults, and its "forward"
    (the next token), which a test may replace to make a request fail as a device would."""

    def __init__(self, label: str, config: dict, generation: dict | None = None):
        self.label, self.config = label, namespace(config)
        self.generation = dict(generation or {})
        self.trained = config_value(config, "max_position_embeddings")
        self.shape = KVShape.from_config(config)
        self.weights_bytes = sum(parameter_counts(config)) * FULL_BYTES

    @staticmethod
    def encode(messages: list[dict]) -> tuple[list[int], list[int]]:
        """The prompt's ids (a generated reply's own ids kept verbatim, as the engine's template
        does) and where each message starts; appending a message never changes the ids before it."""
        ids, starts = [], []
        for m in messages:
            starts.append(len(ids))
            body = m.get("token_ids") or [token_id(p) for p in pieces(m["content"])]
            ids += [token_id("<|im_start|>"), token_id(m["role"]), *body, token_id("<|im_end|>")]
        return ids + [token_id("<|im_start|>"), token_id("assistant")], starts

    def forward(self, stream) -> tuple[str, int]:
        """The next (text, id) of a reply; id EOS ends it."""
        return next(stream)

    def replies(self, messages: list[dict], sampling):
        """The reply's tokens, endless: the canned answer, then EOS (or, ignoring EOS, a story that
        never repeats itself). Sampled replies depend on the seed only."""
        question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "").lower()
        if any(r in question for r in REPEATS):
            while True:
                yield " la", token_id(" la")
        answer = next((a for key, a in CANNED if re.search(rf"\b{re.escape(key)}\b", question)),
                      f"You said: {' '.join(question.split()[:6])}.")
        for p in pieces(answer):
            yield p, token_id(p)
        if not sampling.ignore_eos:
            yield "", EOS
        rng = random.Random(sampling.seed if sampling.seed is not None else zlib.crc32(question.encode()))
        while True:
            word = " " + rng.choice(STORY)
            yield word, token_id(word)


class PersonaDisk:
    """Personas' KV saved "on disk": shared by the fakes a test makes, as a restart shares the folder."""

    def __init__(self):
        self.saved: set = set()
        self.lock = threading.Lock()

    def has(self, key) -> bool:
        with self.lock:
            return key in self.saved

    def add(self, key) -> None:
        with self.lock:
            self.saved.add(key)


class PrefixCache:
    """Full 16-token blocks of what was computed, named by their whole prefix (a chained hash)."""

    def __init__(self):
        self.blocks: set[tuple] = set()
        self.lock = threading.Lock()

    def matched(self, ids: list[int]) -> int:
        """Tokens of ``ids`` found cached, in whole blocks, the last token always computed."""
        n = 0
        with self.lock:
            while (n + 1) * BLOCK_SIZE < len(ids) and tuple(ids[:(n + 1) * BLOCK_SIZE]) in self.blocks:
                n += 1
        return n * BLOCK_SIZE

    def add(self, ids: list[int]) -> None:
        with self.lock:
            self.blocks.update(tuple(ids[:end]) for end in range(BLOCK_SIZE, len(ids) + 1, BLOCK_SIZE))

    def holds(self, ids: list[int]) -> bool:
        with self.lock:
            return tuple(ids) in self.blocks

    def clear(self) -> None:
        with self.lock:
            self.blocks.clear()

    def tokens(self) -> int:
        with self.lock:
            return len(self.blocks) * BLOCK_SIZE


def persona_ids(model: FakeModel, system_prompt: str) -> list[int]:
    """The persona's full blocks, as a request with it names them (persona_probe's question)."""
    ids, starts = model.encode([{"role": "system", "content": system_prompt}, {"role": "user", "content": "."}])
    return ids[:starts[1] // BLOCK_SIZE * BLOCK_SIZE]


def kv_bytes(model: FakeModel, context: int, precision: Precision) -> int:
    return int(context * (1 + PREFIX_RESERVE) * bytes_per_token(model.shape, precision, FULL_BYTES)) + 1


def snapshot(model: FakeModel, config, precision: Precision, cached_tokens: int, in_use: int) -> MemorySnapshot:
    """Where the fake machine's memory goes, computed as the engine's governor does."""
    activations = activations_bytes(model.config, config.prefill_chunk, FULL_BYTES, config.max_context)
    kv_total = kv_bytes(model, config.max_context, precision)
    per_token = bytes_per_token(model.shape, precision, FULL_BYTES)
    used = min(kv_total, int(in_use * per_token))
    reclaimable = min(kv_total - used, int(cached_tokens * per_token))
    kv_room = MACHINE_RAM - OTHER_PROGRAMS - RUNTIME - model.weights_bytes - activations - config.headroom_bytes
    room = max(kv_total, kv_room)
    return MemorySnapshot(
        device="cpu", total=MACHINE_RAM, other_processes=OTHER_PROGRAMS, weights=model.weights_bytes,
        kv_total=kv_total, kv_in_use=used, kv_reclaimable=reclaimable, activations_reserve=activations,
        free=max(0, kv_room + config.headroom_bytes - kv_total), precision=precision.value,
        max_context={p.value: int(room // (bytes_per_token(model.shape, p, FULL_BYTES) * BLOCK_SIZE)) * BLOCK_SIZE
                     for p in LADDER}, on_cpu=True, runtime=RUNTIME)


def layout(model: FakeModel, config) -> Precision:
    """The pool's precision (Auto starts at fp16), or ConfigError when the context cannot fit."""
    from kvchat.core.config import ConfigError

    precision = Precision.FP16 if config.kv_precision == Precision.AUTO else config.kv_precision
    available = MACHINE_RAM - OTHER_PROGRAMS - model.weights_bytes - config.headroom_bytes - activations_bytes(
        model.config, config.prefill_chunk, FULL_BYTES, config.max_context)
    lowest = Precision.INT4 if config.kv_precision == Precision.AUTO else precision
    need = kv_bytes(model, config.max_context, lowest)
    if need > available:
        raise ConfigError(f"a context of {config.max_context:,} tokens needs {need / 2**20:,.0f} MiB of KV cache at "
                          f"{lowest.value}; {max(0, available) / 2**20:,.0f} MiB are free: lower the context"
                          + ("" if lowest == Precision.INT4 else " or the precision"))
    return precision
