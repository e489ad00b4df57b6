"""The model host: loading a model and building its pool, dropping them, bringing the previous model
back after a failed switch, and preparing the decode step. It runs on the engine thread and keeps
what it loads on the Engine (config, loaded, kvpool and what follows from them)."""
import ctypes
import gc
import logging
import shutil
import weakref
from dataclasses import replace
from time import perf_counter

import torch

from kvchat.core.commands import LoadModel, refuse
from kvchat.core.config import ConfigError, EngineConfig, Precision
from kvchat.core.errors import first_line
from kvchat.core.events import PREPARING, EngineError, LoadFailed, LoadProgress, ModelReady
from kvchat.core.kv_sizes import KVShape, config_value, local_blocks_for, pool_blocks, pool_bytes, quantizable
from kvchat.core.memory_policy import MemoryPolicy
from kvchat.core.memory import activations_bytes, pool_span
from kvchat.core.paths import cache_dir
from kvchat.engine.chat import ChatFormatter
from kvchat.engine.compile_child import CacheWarmer
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.pool import KVPool, kv_dtype
from kvchat.engine.memory_probe import MemoryProbe
from kvchat.engine.model.loading import LoadedModel, ModelError, load

log = logging.getLogger("kvchat.engine")


def preparing(expected: float | None) -> str:
    """The background compile's notice, with what it took here the last time: the app counts the
    time against it (a first compile took 2-3 minutes on two quiet cores)."""
    if not expected:
        return PREPARING + " (a minute or more the first time)"
    took = f"{expected / 60:.0f} min" if expected >= 90 else f"{expected:.0f} s"
    return PREPARING + f" (it took {took} here the last time)"


class ModelHost:
    def __init__(self, engine, probe, disk_tier: DiskTier | bool | None = True):
        self.engine = weakref.proxy(engine)  # the engine owns this: no cycle keeps a closed engine's model alive
        self.given_probe = probe
        self.disk = disk_tier  # as given, True: kvchat's cache dir at the config's cap, None: off
        self.good: tuple[EngineConfig, LoadedModel | None] | None = None  # what a failed switch goes back to
        self.warmed = self.fallback_told = False  # CUDA's smallest graph captured for this pool; a fallback told once
        self.warmer: CacheWarmer | None = None  # the children compiling the loaded model's graphs

    # -- loading and dropping --

    def load(self, command: LoadModel) -> None:
        """Drop the model, load the new one; on failure load the previous one again."""
        e = self.engine
        if e.loads.superseded(command.seq):
            return refuse(command, "replaced by a later model choice")
        e.ready.clear()
        try:
            self.drop()
            try:
                self.start(command.config, command.loaded, command.seq)
            except Exception as error:
                return self.failed(command, load_failure(error))
            self.good = (e.config, command.loaded)
            e.load_error = None
            settings = e.settings()
            command.future.set_result(settings)
            e.announce(ModelReady(e.loaded.source.label, settings, e.loaded.model.config,
                                  generation_settings(e.loaded.model)))
        finally:
            if e.loads.ended(command.seq):
                e.ready.set()

    def failed(self, command: LoadModel, reason: str) -> None:
        e = self.engine
        self.drop(check=False)
        if e.loads.superseded(command.seq):
            return refuse(command, "replaced by a later model choice")
        restored = self.good is not None and self.restore()
        message = reason + ("; the previous model is back" if restored else "")
        e.load_error = None if restored else reason
        command.future.set_exception(EngineError(message))
        e.announce(LoadFailed(message, e.settings() if restored else None))

    def restore(self) -> bool:
        config, loaded = self.good
        try:
            self.start(config, loaded, None)
        except Exception as error:
            log.exception("the previous model could not be loaded again")
            self.drop(check=False)
            self.good = None
            self.engine.notice("load", f"the previous model could not be loaded again: {load_failure(error)}")
            return False
        return True

    def start(self, config: EngineConfig, loaded: LoadedModel | None, seq: int | None) -> None:
        """Load the model (unless given) and build its pool; raises with the reason."""
        e = self.engine
        e.config = cfg = config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        progress = lambda done, total, stage: self.progress(seq, done, total, stage)
        lm = loaded or load(cfg.model, cfg.device, cfg.dtype, cfg.weights, progress=progress, decode=cfg.decode)
        why = e.loads.stop_reason(seq)
        if why:
            raise ModelError(why)
        e.loaded = lm
        e.formatter = ChatFormatter(lm.tokenizer)
        e.eos_ids = eos_token_ids(lm)
        e.probe = self.given_probe or MemoryProbe(lm.device)
        e.weights_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
        e.activations = activations_bytes(lm.model.config, cfg.prefill_chunk, lm.dtype.itemsize, cfg.max_context)
        e.config = cfg = self.capped(cfg)
        e.policy = self.policy(cfg)
        precision, budget = self.layout(cfg)
        e.kvpool = KVPool(lm, cfg.block_size, precision, budget, cfg.decode, cfg.ram_cache_bytes,
                          self.disk_tier(cfg), e.notice, self.ring_blocks(cfg), self.span(cfg))
        self.warmed = self.fallback_told = False
        if loaded is None:  # a model handed in may have no source a child could load
            total, used = e.probe.totals()
            self.warmer = CacheWarmer.for_model(cfg, lm.device.type, total - used, e.weights_bytes)
        e.governor.next_snapshot = 0.0

    def disk_tier(self, cfg: EngineConfig) -> DiskTier | None:
        """The engine's disk tier (made once: the cache dir outlives models), or None when off."""
        if self.disk is True:
            shutil.rmtree(cache_dir() / "persona-kv", ignore_errors=True)  # earlier versions' persona store
            self.disk = DiskTier(cap_bytes=cfg.disk_cache_bytes) if cfg.disk_cache_bytes else None
        return self.disk or None

    def drop(self, check: bool = True) -> None:
        """Let go of the model and the pool and give their memory back before anything new loads.
        With ``check``, the probe must see most of it return, or the user is told."""
        e = self.engine
        if e.loaded is None and e.kvpool is None:
            return
        expected = e.weights_bytes + (e.kvpool.kv.nbytes if e.kvpool else 0)
        ours = check and self.good is not None and self.good[1] is None  # not a model a caller still holds
        before = e.probe.own() if ours else 0
        self.end_compiles()
        e.kvpool = e.loaded = e.formatter = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        trim_heap()
        if ours:
            freed = before - e.probe.own()
            if freed < expected // 2:
                e.notice("memory", f"the previous model's memory did not all come back: "
                                   f"{freed / 2**20:.0f} of {expected / 2**20:.0f} MiB freed")

    def progress(self, seq: int | None, done: int, total: int, stage: str) -> None:
        """Called by a download after each chunk and a GGUF conversion after each tensor; raising
        here is how they stop."""
        why = self.engine.loads.stop_reason(seq)
        if why:
            raise ModelError(why)
        self.engine.emit(LoadProgress(done, total, stage))

    # -- the pool's size --

    def capped(self, cfg: EngineConfig) -> EngineConfig:
        """The context is capped at what the model was trained for, unless the config allows more."""
        trained = config_value(self.engine.loaded.model.config, "max_position_embeddings")
        if not trained or cfg.max_context <= trained:
            return cfg
        if cfg.allow_long_context:
            self.engine.notice("context", f"{cfg.max_context:,} tokens is longer than the {trained:,} "
                                          "the model was trained for: expect worse answers past that")
            return cfg
        self.engine.notice("context", f"{cfg.max_context:,} tokens capped at {trained:,}, the length the model "
                                      "was trained for")
        return replace(cfg, max_context=trained)

    def layout(self, cfg: EngineConfig) -> tuple[Precision, int]:
        """The pool's precision and bytes, sized from the context (never from all that is free).
        Auto starts at fp16, the best quality, in at most the bytes a full fp16 context needs, and
        steps down when the conversation outgrows them or memory runs short."""
        policy = self.policy(cfg)
        if cfg.kv_budget_bytes is not None:
            return policy.rungs()[0], cfg.kv_budget_bytes
        total, used = self.engine.probe.totals()
        available = total - used - self.engine.activations - cfg.headroom_bytes
        if available <= 0:
            raise ConfigError("not enough free memory for a KV cache; lower the context or free memory")
        want = self.kv_bytes(cfg.max_context, policy.rungs()[0])
        lowest = policy.lowest()
        need = self.kv_bytes(cfg.max_context, lowest)
        if need > available:
            raise ConfigError(f"a context of {cfg.max_context:,} tokens needs {need / 2**20:,.0f} MiB of KV cache at "
                              f"{lowest.value}; {available / 2**20:,.0f} MiB are free: lower the context"
                              + ("" if lowest == Precision.INT4 else " or the precision"))
        budget = min(want, available)
        shape, local = KVShape.from_config(self.engine.loaded.model.config), self.ring_blocks(cfg)
        full = kv_dtype(self.engine.loaded).itemsize
        # Auto: where the rings alone fill the budget at fp16, a lower rung leaves blocks beside them
        holds = lambda p: pool_blocks(shape, p, cfg.block_size, budget, full, local, self.span(cfg))[0] >= 1
        return policy.start(holds), budget

    def policy(self, cfg: EngineConfig) -> MemoryPolicy:
        return MemoryPolicy(cfg.kv_precision, quantizable(KVShape.from_config(self.engine.loaded.model.config)))

    def ring_blocks(self, cfg: EngineConfig) -> int | None:
        """The windowed layers' ring blocks for ``cfg``'s context (kv/rings.py), where they take
        less than whole blocks; a budget given in bytes decides them itself (None)."""
        if cfg.kv_budget_bytes is not None:
            return None
        return local_blocks_for(KVShape.from_config(self.engine.loaded.model.config), cfg.block_size, self.span(cfg))

    @staticmethod
    def span(cfg: EngineConfig) -> int:
        return pool_span(cfg.max_context)

    def kv_bytes(self, context: int, precision: Precision) -> int:
        """What a pool for ``context`` tokens plus the prefix-cache reserve takes."""
        loaded = self.engine.loaded
        return pool_bytes(KVShape.from_config(loaded.model.config), precision, pool_span(context),
                          kv_dtype(loaded).itemsize, self.engine.config.block_size) + 1

    # -- the decode step --

    def prepare_decode(self, between_tokens: bool = False) -> None:
        """Have the decode step prepared for the pool without making anything wait for it. On the
        CPU a child process compiles the graph and the int8 weights' twins into the disk cache
        while replies decode eagerly (a minute or two the first time); once it ended, in an idle
        moment, a thread of this process compiles both from that cache (seconds), or from scratch
        where the RAM holds no child. A compile here holds the GIL: during the twins' compile
        (25 s in a venv, 108 s packaged) a reply crawled at 2 tok/s. On CUDA the smallest graph
        is captured in an idle second, never between two tokens of a reply. Also says when a
        compile has ended."""
        e = self.engine
        if e.kvpool is None:
            return
        step, kv, warmer = e.kvpool.runner.step, e.kvpool.kv, self.warmer
        kind = step.graph_wanted(kv)
        if warmer is not None and kind is not None:  # a child compiles; this process, from its result when idle
            if warmer.start(kind):
                e.notice("warm-up", preparing(warmer.expected(kind)))
            if not between_tokens and warmer.done(kind):
                step.prepare(kv)
        elif step.prepare(kv):
            e.notice("warm-up", PREPARING)
        if not between_tokens and e.kvpool.runner.batch.prepare(kv):  # the batch sizes replies have run in
            log.info("compiling the batched decode step for %s sequences", sorted(e.kvpool.runner.batch.wanted))
        if step.device.type == "cuda" and not between_tokens and step.capture_failed:
            reason = step.capture_failed
            e.notice("warm-up", f"capturing the decode step failed ({reason}); trying once more")
            step.retry_capture(kv)
            if step.captured and step.capture_failed is None:
                e.notice("warm-up", "fast decoding ready (captured on the second try)")
        if step.device.type == "cuda" and step.captured and not self.warmed and not between_tokens:
            self.warmed = True
            e.notice("warm-up", "preparing fast decoding (capturing the decode step: seconds, a minute the first time)")
            started = perf_counter()
            try:
                step.warm_up(e.kvpool.kv)
            except Exception:
                log.exception("capturing the decode step failed")
            if step.captured:
                e.notice("warm-up", f"fast decoding ready ({perf_counter() - started:.0f} s)")
        self.report_decode()

    def report_decode(self) -> None:
        """Say when a background compile has ended, between two tokens or in an idle second: the
        next token is the first at full speed."""
        e = self.engine
        if e.kvpool is None:
            return
        for job, seconds in e.kvpool.runner.step.background.take_finished():
            log.info("%s compiled in %.1f s", job, seconds)
            if job != "weights" and not e.kvpool.runner.batch.owns(job):
                seconds = max(seconds, self.warmer.seconds(job) if self.warmer else 0.0)  # from the child's start
                e.notice("warm-up", f"fast decoding ready ({seconds:.0f} s)")
        self.report_fallback()

    def end_compiles(self) -> None:
        """Stop the model's compile children (a model change, the engine's end)."""
        if self.warmer is not None:
            self.warmer.close()
            self.warmer = None

    def report_fallback(self) -> None:
        e = self.engine
        reason = e.kvpool.runner.step.fallback if e.kvpool is not None else None
        if reason and not self.fallback_told:
            self.fallback_told = True
            e.notice("eager", reason)


def load_failure(e: Exception) -> str:
    if isinstance(e, (ModelError, ConfigError, EngineError)):
        return str(e)
    log.exception("model load failed")
    return f"model load failed: {first_line(e)}"


def trim_heap() -> None:
    """Hand freed heap pages back to the system (glibc keeps them otherwise), so that the probe
    sees a dropped model's memory return and the next model can use it."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def eos_token_ids(lm: LoadedModel) -> set[int]:
    ids = set()
    for source in (lm.model.config, getattr(lm.model, "generation_config", None)):
        value = getattr(source, "eos_token_id", None)
        ids.update(value if isinstance(value, (list, tuple)) else [value] if value is not None else [])
    if lm.tokenizer.eos_token_id is not None:
        ids.add(lm.tokenizer.eos_token_id)
    return ids


def generation_settings(model) -> dict:
    """What the model's authors set in its generation_config.json (``to_diff_dict``: transformers'
    own defaults, e.g. top_k 50, say nothing about this model), as plain values for the app."""
    config = getattr(model, "generation_config", None)
    try:
        return config.to_diff_dict() if config is not None else {}
    except Exception:  # a model's odd generation config costs its defaults, never the load
        log.exception("the model's generation config could not be read")
        return {}
