"""The Engine: one background thread owns the model and the KV pool and serves queued requests."""
import logging
import queue
import threading
import time

import torch

from .block_pool import BlockPool, PoolExhausted
from .calibration import calibrate
from .chat import ChatError, ChatFormatter
from .config import ConfigError, EngineConfig, SamplingParams
from .detok import StopChecker, StreamDetokenizer
from .events import EngineError, Error, Finished, Request, RequestHandle, Stats, TokenDelta
from .kv_cache import KVCache, KVShape, blocks_for_budget
from .kv_manager import KVCacheManager, Sequence
from .models import LoadedModel, ModelError, load
from .persona_store import PersonaStore
from .personas import PersonaCache
from .runner import ModelRunner
from .sampler import Sampler

log = logging.getLogger("kvchat.engine")
PREFIX_RESERVE = 0.5  # pool room beyond one full context, kept for cached prefixes


class Engine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 persona_store: PersonaStore | None | bool = True):
        self.config = config or EngineConfig()
        self.loaded = loaded
        self._store_arg = persona_store
        self.ready = threading.Event()
        self.load_error: str | None = None
        self._requests: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._main, name="kvchat-engine", daemon=True)
        self._thread.start()

    # -- public API, any thread --

    def submit(self, request: Request) -> RequestHandle:
        handle = RequestHandle(request)
        self._requests.put(handle)
        return handle

    def generate(self, messages: list[dict], **sampling) -> Finished:
        return self.submit(Request(messages=messages, sampling=SamplingParams(**sampling))).result()

    def wait_ready(self, timeout: float | None = None) -> None:
        if not self.ready.wait(timeout):
            raise EngineError("the model is still loading")
        if self.load_error:
            raise EngineError(self.load_error)

    def close(self) -> None:
        self._requests.put(None)
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the engine thread --

    def _main(self) -> None:
        try:
            self._setup()
        except (ModelError, ConfigError, EngineError) as e:
            self.load_error = str(e)
        except Exception as e:  # never leave callers waiting on a thread that died
            log.exception("model load failed")
            self.load_error = f"model load failed: {e}"
        self.ready.set()
        while (handle := self._requests.get()) is not None:
            if self.load_error:
                handle.events.put(Error(self.load_error))
                continue
            self._serve(handle)

    def _setup(self) -> None:
        cfg = self.config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        if self.loaded is None:
            self.loaded = load(cfg.model, cfg.device, cfg.dtype, cfg.weights)
        lm = self.loaded
        self.formatter = ChatFormatter(lm.tokenizer)
        self.shape = KVShape.from_config(lm.model.config)
        kv_dtype = lm.dtype if lm.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.float16
        num_blocks = self._num_blocks(kv_dtype.itemsize)
        self.pool = BlockPool(num_blocks)
        self.kv = KVCache(self.shape, num_blocks, cfg.block_size, kv_dtype, lm.device, cfg.kv_precision)
        if self.kv.format.quantized:
            self.kv.k_centers, self.kv.k_scales = calibrate(lm.model, lm.tokenizer, lm.device, kv_dtype)
        self.manager = KVCacheManager(self.pool, cfg.block_size, f"{lm.identity}|{self.kv.layout_key}")
        self.runner = ModelRunner(lm.model, self.kv, self.manager)
        store = PersonaStore() if self._store_arg is True else (self._store_arg or None)
        self.personas = PersonaCache(self.manager, self.kv, store)
        self.eos_ids = eos_token_ids(lm)

    def _num_blocks(self, dtype_bytes: int) -> int:
        cfg = self.config
        if cfg.kv_budget_bytes is not None:
            n = blocks_for_budget(self.shape, cfg.kv_precision, cfg.block_size, cfg.kv_budget_bytes, dtype_bytes)
            if n < 1:
                raise ConfigError("the KV budget is smaller than one block")
            return n
        per_context = -(-cfg.max_context // cfg.block_size)
        return int(per_context * (1 + PREFIX_RESERVE)) + 1

    def _serve(self, handle: RequestHandle) -> None:
        """Run one request; its blocks are released before the last event, so a caller that saw
        Finished or Error sees the pool as the engine leaves it."""
        seq, persona_len = None, 0
        try:
            prompt, persona_len = self._prompt_ids(handle.request)
            seq = Sequence(list(prompt))
            last = self._generate(handle, seq, len(prompt), persona_len)
        except (ChatError, ConfigError, PoolExhausted, EngineError) as e:
            last = Error(str(e))
        except Exception as e:
            log.exception("request failed")
            last = Error(f"internal error: {type(e).__name__}: {e}", internal=True)
        finally:
            if seq is not None:
                self._release(seq, persona_len)
        handle.events.put(last)

    def _release(self, seq: Sequence, persona_len: int) -> None:
        """After the reply (never before the first token): pin and persist the persona, free blocks."""
        try:
            self.personas.remember(seq, persona_len)
        except Exception:
            log.exception("could not remember the persona")
        self.manager.free(seq)

    def _prompt_ids(self, request: Request) -> tuple[list[int], int]:
        """The prompt's token ids, and how many of them are the persona (the system message)."""
        persona_len = 0
        if request.prompt_ids is not None:
            ids = list(request.prompt_ids)
            vocab = self.loaded.model.config.vocab_size
            if not ids or not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
                raise ChatError(f"prompt_ids must be a non-empty list of token ids below {vocab}")
        else:
            encoded = self.formatter.encode(request.messages)
            ids = encoded.token_ids
            if request.messages[0]["role"] == "system":
                persona_len = encoded.message_starts[1] if len(request.messages) > 1 else encoded.prompt_start
        limit = self.config.max_context
        if len(ids) >= limit:
            raise EngineError(f"the prompt is {len(ids)} tokens, longer than the context of {limit}")
        return ids, persona_len

    def _generate(self, handle: RequestHandle, seq: Sequence, prompt_len: int, persona_len: int) -> Finished:
        cfg, sp = self.config, handle.request.sampling
        start = time.perf_counter()
        stats = Stats(prompt_tokens=prompt_len, kv_precision=cfg.kv_precision.value)
        self.manager.match_prefix(seq)
        self.personas.restore(seq, persona_len)
        stats.cached_tokens = seq.num_computed
        logits = None
        while seq.num_computed < prompt_len:
            if handle.cancelled:
                return Finished("", [], "cancelled", stats)
            end = min(seq.num_computed + cfg.prefill_chunk, prompt_len)
            self.manager.reserve(seq, end)
            logits = self.runner.forward(seq, end, want_logits=end == prompt_len)
            self.manager.commit(seq)
        sampler = Sampler(sp, device=self.loaded.device)
        detok, stops = StreamDetokenizer(self.loaded.tokenizer), StopChecker(sp.stop)
        text, generated, reason = [], [], "length"
        first_at = None
        while True:
            seen = torch.tensor(seq.token_ids, device=logits.device) if sp.repetition_penalty != 1 else None
            token = sampler(logits, seen)
            if first_at is None:
                first_at = time.perf_counter()
            seq.token_ids.append(token)
            generated.append(token)
            if token in self.eos_ids and not sp.ignore_eos:
                reason = "stop"
                break
            delta = stops.feed(detok.add(token))
            text.append(delta)
            handle.events.put(TokenDelta(delta, token))
            if stops.stopped:
                reason = "stop"
                break
            if len(generated) >= sp.max_new_tokens or len(seq) >= cfg.max_context:
                break
            if handle.cancelled:
                reason = "cancelled"
                break
            self.manager.reserve(seq, len(seq))
            logits = self.runner.forward(seq, len(seq), want_logits=True)
            self.manager.commit(seq)
        if not stops.stopped:
            tail = stops.flush()
            if tail:
                text.append(tail)
                handle.events.put(TokenDelta(tail, -1))
        done = time.perf_counter()
        stats.ttft_ms = (first_at - start) * 1000
        stats.decode_tok_s = (len(generated) - 1) / (done - first_at) if len(generated) > 1 else 0.0
        stats.generated_tokens = len(generated)
        return Finished("".join(text), generated, reason, stats)


def eos_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (lm.model.config, getattr(lm.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids
