"""The memory governor, on the engine thread: about once a second a snapshot of where memory goes,
and the session's pool shrunk (and, under Auto, its precision stepped down as
``core.memory_policy`` says) when another program takes memory; context, precision and headroom
changed on request without reloading the weights: a new session around the same pool, rebuilt."""
import logging
import time
from dataclasses import replace

import torch

from kvchat.core.commands import Reconfigure, Refused
from kvchat.core.config import ConfigError, Precision
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, Reconfigured
from kvchat.core.memory import PRECISIONS, MemorySnapshot
from kvchat.engine.kv.manager import Sequence
from kvchat.engine.session import Session

log = logging.getLogger("kvchat.engine")
PRESSURE_SLACK = 256 << 20  # short by less (or an eighth of the pool): a module loaded late, not a program
SNAPSHOT_PERIOD = 1.0  # seconds between memory snapshots


class MemoryGovernor:
    def __init__(self, outbox):
        self.out = outbox
        self.next_snapshot = 0.0

    def soon(self) -> None:
        """The next tick takes its snapshot at once: the pool changed."""
        self.next_snapshot = 0.0

    def tick(self, session: Session | None, live: list[Sequence] = ()) -> None:
        """About once a second: relieve memory pressure, then tell the listeners where memory goes."""
        now = time.monotonic()
        if now < self.next_snapshot or session is None:
            return
        self.next_snapshot = now + SNAPSHOT_PERIOD
        try:
            total, used = session.probe.totals()
            own = session.probe.own()
        except Exception:  # a probe failing must never stop the engine
            log.exception("memory probe failed")
            return
        other = max(0, used - own)
        # pressure is judged on other programs alone: what the pool gives back may stay in this
        # process's pages for a while, and counting it would shrink the pool again
        self.relieve_pressure(session, total, other, list(live))
        self.out.emit(snapshot(session, total, other, own))

    def relieve_pressure(self, s: Session, total: int, other: int, live: list[Sequence]) -> None:
        """Another process took memory: shrink the pool to give it back, stepping the precision down
        (Auto) so that what is in use still fits. Unreferenced cached blocks go first."""
        pool, notice = s.kvpool, self.out.notice
        allowed = kv_room(s, total, other)
        if allowed >= pool.budget - min(PRESSURE_SLACK, pool.budget // 8):
            return
        needed = (pool.blocks.num_blocks - pool.blocks.num_free) * pool.block_size
        old = pool.precision
        choice = s.policy.under_pressure(old, lambda p: pool.tokens_for(p, allowed), max(needed, pool.block_size),
                                         s.config.max_context)
        if choice == old and not gives_back(pool, choice, allowed):
            pool.budget = allowed  # its bytes (its rings) already fit: nothing to rebuild or to say
            return
        if choice is None:
            return notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        try:
            done = rebuild(s, choice, allowed, live)
        except EngineError as error:
            return notice("pressure", f"memory is short and the KV cache could not shrink: {error}")
        if not done:
            return notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        notice("shrink" if choice == old else "downshift",
               f"another program took memory: KV cache now {allowed / 2**20:.0f} MiB"
               + (f", {old.value} -> {choice.value}" if choice != old else ""))

    def control(self, session: Session, command: Reconfigure) -> Session:
        """A Reconfigure: the session with the new settings, or ``session`` itself, as it was, with
        the command's future told why not."""
        try:
            new = reconfigure(session, command.max_context, command.kv_precision, command.headroom_bytes)
        except Refused as error:
            self.out.notice("rebuild", f"settings not applied: {error}")
            command.future.set_exception(error)
            return session
        except (ConfigError, ValueError) as error:
            command.future.set_exception(ConfigError(str(error)))
            return session
        except EngineError as error:
            self.out.notice("rebuild", str(error))
            command.future.set_exception(error)
            return session
        except Exception as error:
            log.exception("reconfigure failed")
            command.future.set_exception(EngineError(f"reconfigure failed: {error}"))
            return session
        settings = {**new.settings(), "kv_budget": new.kvpool.budget}  # the whole config: the app shows it as it is
        self.soon()
        command.future.set_result(settings)
        self.out.emit(Reconfigured(settings))
        return new


def kv_room(s: Session, total: int, other: int) -> int:
    """Bytes the KV pool may take: what the device has, less everything else and the headroom."""
    return total - other - s.weights_bytes - s.activations - s.config.headroom_bytes


def snapshot(s: Session, total: int, other: int, own: int = 0) -> MemorySnapshot:
    """``own``: this process's bytes; beyond its weights and pool (its runtime) they would
    otherwise pass for free."""
    pool = s.kvpool
    usage = pool.usage()
    runtime = max(0, own - s.weights_bytes - usage["kv_total"])
    room_now = kv_room(s, total, other + runtime)
    free = room_now + s.config.headroom_bytes - usage["kv_total"]
    room = max(usage["kv_total"], room_now)  # what the pool could grow to now
    device = s.loaded.device
    return MemorySnapshot(
        device=str(device), total=total, other_processes=other, weights=s.weights_bytes,
        activations_reserve=s.activations, free=max(0, free), precision=pool.precision.value,
        max_context={p.value: pool.tokens_for(p, room) for p in PRECISIONS},
        on_cpu=device.type == "cpu", runtime=runtime, **usage)


def gives_back(pool, precision: Precision, budget: int) -> bool:
    """A pool wholly in rings (every layer windowed) takes their bytes whatever its budget: rebuilt
    to a smaller budget it came back the same size, and said it had shrunk."""
    try:
        return pool.nbytes_for(precision, budget) < pool.kv.nbytes
    except ConfigError:  # not one block beside the rings: rebuild says why
        return True


def rebuild(s: Session, precision: Precision, budget: int, live: list[Sequence] = (),
            local_blocks: int | None = None, span: int | None = None) -> bool:
    """Allocate the new pool, convert, swap, free the old; False when live blocks would not fit.
    Refused up front when the new pool cannot be allocated next to the old; a failure part way
    leaves the old pool as it was (convert.converted is transactional) and raises EngineError."""
    pool = s.kvpool
    try:
        new_bytes = pool.nbytes_for(precision, budget, local_blocks, span)
    except ConfigError as error:  # not one block beside the rings
        raise Refused(str(error)) from None
    total, used = s.probe.totals()
    free = total - used
    if new_bytes > free:
        raise Refused(f"the new KV cache needs {new_bytes / 2**20:,.0f} MiB next to the current "
                      f"{pool.kv.nbytes / 2**20:,.0f} MiB, and {max(0, free) / 2**20:,.0f} MiB are free")
    try:
        done = pool.rebuild(precision, budget, live, local_blocks, span)
    except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
        raise EngineError(f"the KV cache could not be rebuilt ({first_line(error)}); it is unchanged") from error
    if done and s.loaded.device.type == "cuda":
        torch.cuda.empty_cache()
    return done


def reconfigure(s: Session, max_context, kv_precision, headroom_bytes) -> Session:
    """The session with new settings applied, or an exception with config and pool exactly as
    they were. A new pool on CUDA is another captured graph (``warmed`` false); the CPU's graph
    serves any pool size."""
    cfg, pool = s.config, s.kvpool
    new_cfg = replace(cfg, max_context=max_context or cfg.max_context,
                      kv_precision=kv_precision or cfg.kv_precision,
                      headroom_bytes=cfg.headroom_bytes if headroom_bytes is None else headroom_bytes)
    new_cfg = s.size.capped(new_cfg)
    precision, budget = s.size.layout(new_cfg)
    upward = PRECISIONS.index(precision) < PRECISIONS.index(pool.precision)
    if not rebuild(s, precision, budget, local_blocks=s.size.ring_blocks(new_cfg), span=s.size.span(new_cfg)):
        raise Refused("the KV cache is in use and cannot be rebuilt now")
    if upward:
        pool.clear_cache()  # lossy blocks and rings must not pass for full-precision ones
    return replace(s, config=new_cfg, policy=s.size.policy(new_cfg), warmed=False)
