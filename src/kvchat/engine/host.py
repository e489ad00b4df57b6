"""The model host: opening a session (loading a model and building its pool), closing one, bringing
the previous model back after a failed switch, and preparing the decode step. It runs on the
engine thread and hands each session it opens to the engine, which holds it."""
import ctypes
import gc
import logging
import shutil
from time import perf_counter

import torch

from kvchat.core.commands import LoadModel, refuse
from kvchat.core.config import ConfigError, EngineConfig
from kvchat.core.errors import first_line
from kvchat.core.events import PREPARING, EngineError, LoadFailed, LoadProgress, ModelReady
from kvchat.core.memory import activations_bytes
from kvchat.core.paths import cache_dir
from kvchat.engine.chat import ChatFormatter
from kvchat.engine.compile_child import CacheWarmer
from kvchat.engine.kv.disk_tier import DiskTier
from kvchat.engine.kv.pool import KVPool
from kvchat.engine.memory_probe import MemoryProbe
from kvchat.engine.model.loading import LoadedModel, ModelError, load
from kvchat.engine.pool_size import PoolSize
from kvchat.engine.session import Session

log = logging.getLogger("kvchat.engine")


def preparing(expected: float | None) -> str:
    """The background compile's notice, with what it took here the last time: the app counts the
    time against it (a first compile took 2-3 minutes on two quiet cores)."""
    if not expected:
        return PREPARING + " (a minute or more the first time)"
    took = f"{expected / 60:.0f} min" if expected >= 90 else f"{expected:.0f} s"
    return PREPARING + f" (it took {took} here the last time)"


class ModelHost:
    def __init__(self, outbox, loads, config: EngineConfig, probe, disk_tier: DiskTier | bool | None = True):
        self.out, self.loads = outbox, loads
        self.config = config  # the last one opened or asked for (capped): the engine's while no model is loaded
        self.given_probe = probe
        self.disk = disk_tier  # as given, True: kvchat's cache dir at the config's cap, None: off
        self.good: tuple[EngineConfig, LoadedModel | None] | None = None  # what a failed switch goes back to
        self.load_error: str | None = None  # why no model is loaded, when none is
        self.fallback_told = False  # an eager fallback told once a session
        self.warmer: CacheWarmer | None = None  # the children compiling the loaded model's graphs

    # -- loading and closing --

    def load(self, command: LoadModel, current: Session | None) -> Session | None:
        """Close ``current``, open the new session; on failure open the previous one again. Returns
        the session loaded now (None: no model)."""
        if current is not None:
            self.close(current)
        try:
            session = self.open(command.config, command.loaded, command.seq)
        except Exception as error:
            reason = load_failure(error)
        else:
            self.good, self.load_error = (session.config, command.loaded), None
            settings = session.settings()
            command.future.set_result(settings)
            self.out.announce(ModelReady(session.loaded.source.label, settings, session.loaded.model.config,
                                         generation_settings(session.loaded.model)))
            return session
        # out of the except block: its traceback no longer holds the failed load's tensors
        free_memory()
        return self.failed(command, reason)

    def applied(self, config: EngineConfig) -> None:
        """A settings change took: a failed switch later brings the model back with it."""
        self.config = config
        if self.good is not None:
            self.good = (config, self.good[1])

    def failed(self, command: LoadModel, reason: str) -> Session | None:
        if self.loads.superseded(command.seq):
            refuse(command, "replaced by a later model choice")
            return None
        session = self.restore() if self.good is not None else None
        message = reason + ("; the previous model is back" if session else "")
        self.load_error = None if session else reason
        command.future.set_exception(EngineError(message))
        self.out.announce(LoadFailed(message, session.settings() if session else None))
        return session

    def restore(self) -> Session | None:
        config, loaded = self.good
        try:
            return self.open(config, loaded, None)
        except Exception as error:
            log.exception("the previous model could not be loaded again")
            reason = load_failure(error)
        free_memory()
        self.good = None
        self.out.notice("load", f"the previous model could not be loaded again: {reason}")
        return None

    def open(self, config: EngineConfig, loaded: LoadedModel | None, seq: int | None) -> Session:
        """Load the model (unless given) and build its pool; raises with the reason."""
        self.config = cfg = config
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        progress = lambda done, total, stage: self.progress(seq, done, total, stage)
        lm = loaded or load(cfg.model, cfg.device, cfg.dtype, cfg.weights, progress=progress, decode=cfg.decode)
        why = self.loads.stop_reason(seq)
        if why:
            raise ModelError(why)
        formatter, eos_ids = ChatFormatter(lm.tokenizer), frozenset(eos_token_ids(lm))  # before any child starts
        probe = self.given_probe or MemoryProbe(lm.device)
        weights_bytes = sum(t.numel() * t.element_size() for t in lm.model.state_dict().values())
        activations = activations_bytes(lm.model.config, cfg.prefill_chunk, lm.dtype.itemsize, cfg.max_context)
        size = PoolSize(lm, probe, activations, self.out.notice)
        self.config = cfg = size.capped(cfg)
        precision, budget = size.layout(cfg)
        kvpool = KVPool(lm, cfg.block_size, precision, budget, cfg.decode, cfg.ram_cache_bytes,
                        self.disk_tier(cfg), self.out.notice, size.ring_blocks(cfg), size.span(cfg))
        self.fallback_told = False
        if loaded is None:  # a model handed in may have no source a child could load
            total, used = probe.totals()
            self.warmer = CacheWarmer.for_model(cfg, lm.device.type, total - used, weights_bytes)
        return Session(cfg, lm, formatter, eos_ids, probe, weights_bytes, activations, size, size.policy(cfg), kvpool)

    def disk_tier(self, cfg: EngineConfig) -> DiskTier | None:
        """The engine's disk tier (made once: the cache dir outlives models), or None when off."""
        if self.disk is True:
            shutil.rmtree(cache_dir() / "persona-kv", ignore_errors=True)  # earlier versions' persona store
            self.disk = DiskTier(cap_bytes=cfg.disk_cache_bytes) if cfg.disk_cache_bytes else None
        return self.disk or None

    def close(self, session: Session) -> None:
        """Let go of the session's model and pool and give their memory back before anything new
        loads; the probe must see most of it return (a model of our own), or the user is told."""
        expected = session.weights_bytes + session.kvpool.kv.nbytes
        ours = self.good is not None and self.good[1] is None  # not a model a caller still holds
        probe = session.probe
        before = own_bytes(probe) if ours else None
        self.end_compiles()
        session.kvpool = session.loaded = session.formatter = session.size = None  # an empty shell is left
        free_memory()
        after = own_bytes(probe) if before is not None else None
        if after is not None:
            freed = before - after
            if freed < expected // 2:
                self.out.notice("memory", f"the previous model's memory did not all come back: "
                                          f"{freed / 2**20:.0f} of {expected / 2**20:.0f} MiB freed")

    def progress(self, seq: int | None, done: int, total: int, stage: str) -> None:
        """Called by a download after each chunk and a GGUF conversion after each tensor; raising
        here is how they stop."""
        why = self.loads.stop_reason(seq)
        if why:
            raise ModelError(why)
        self.out.emit(LoadProgress(done, total, stage))

    # -- the decode step --

    def prepare_decode(self, session: Session | None, between_tokens: bool = False) -> None:
        """Have the decode step prepared for the pool without making anything wait for it. On the
        CPU a child process compiles the graph and the int8 weights' twins into the disk cache
        while replies decode eagerly (a minute or two the first time); once it ended, in an idle
        moment, a thread of this process compiles both from that cache (seconds), or from scratch
        where the RAM holds no child. A compile here holds the GIL: during the twins' compile
        (25 s in a venv, 108 s packaged) a reply crawled at 2 tok/s. On CUDA the smallest graph
        is captured in an idle second, never between two tokens of a reply. Also says when a
        compile has ended."""
        if session is None:
            return
        notice, runner = self.out.notice, session.kvpool.runner
        step, kv, warmer = runner.step, session.kvpool.kv, self.warmer
        kind = step.graph_wanted(kv)
        if warmer is not None and kind is not None:  # a child compiles; this process, from its result when idle
            if warmer.start(kind):
                notice("warm-up", preparing(warmer.expected(kind)))
            if not between_tokens and warmer.done(kind):
                step.prepare(kv)
        elif step.prepare(kv):
            notice("warm-up", PREPARING)
        if not between_tokens and runner.batch.prepare(kv):  # the batch sizes replies have run in
            log.info("compiling the batched decode step for %s sequences", sorted(runner.batch.wanted))
        if step.device.type == "cuda" and not between_tokens and step.capture_failed:
            reason = step.capture_failed
            notice("warm-up", f"capturing the decode step failed ({reason}); trying once more")
            step.retry_capture(kv)
            if step.captured and step.capture_failed is None:
                notice("warm-up", "fast decoding ready (captured on the second try)")
        if step.device.type == "cuda" and step.captured and not session.warmed and not between_tokens:
            session.warmed = True
            notice("warm-up", "preparing fast decoding (capturing the decode step: seconds, a minute the first time)")
            started = perf_counter()
            try:
                step.warm_up(kv)
            except Exception:
                log.exception("capturing the decode step failed")
            if step.captured:
                notice("warm-up", f"fast decoding ready ({perf_counter() - started:.0f} s)")
        self.report_decode(runner)

    def report_decode(self, runner) -> None:
        """Say when a background compile has ended, between two tokens or in an idle second: the
        next token is the first at full speed; and, once, when decoding fell back to eager."""
        for job, seconds in runner.step.background.take_finished():
            log.info("%s compiled in %.1f s", job, seconds)
            if job != "weights" and not runner.batch.owns(job):
                seconds = max(seconds, self.warmer.seconds(job) if self.warmer else 0.0)  # from the child's start
                self.out.notice("warm-up", f"fast decoding ready ({seconds:.0f} s)")
        reason = runner.step.fallback
        if reason and not self.fallback_told:
            self.fallback_told = True
            self.out.notice("eager", reason)

    def end_compiles(self) -> None:
        """Stop the model's compile children (a model change, the engine's end)."""
        if self.warmer is not None:
            self.warmer.close()
            self.warmer = None


def load_failure(e: Exception) -> str:
    if isinstance(e, (ModelError, ConfigError, EngineError)):
        return str(e)
    log.exception("model load failed")
    return f"model load failed: {first_line(e)}"


def own_bytes(probe) -> int | None:
    """This process's bytes, or None where the probe fails (it must not stop a model switch)."""
    try:
        return probe.own()
    except Exception:
        log.exception("memory probe failed")
        return None


def free_memory() -> None:
    """What a closed or failed session let go of, back to the system before anything new loads:
    its cycles collected, CUDA's cached blocks and the heap's free pages returned (glibc keeps
    them otherwise), so that the probe sees the memory return and the next model can use it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim_heap()


def trim_heap() -> None:
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
