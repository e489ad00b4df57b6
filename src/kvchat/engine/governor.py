"""The memory governor, on the engine thread: about once a second a snapshot of where memory goes,
and the pool shrunk (and, under Auto, its precision stepped down as ``core.memory_policy`` says)
when another program takes memory;
context, precision and headroom changed on request without reloading the weights."""
import logging
import weakref
import time
from dataclasses import replace

import torch

from kvchat.core.commands import Reconfigure, Refused
from kvchat.core.config import ConfigError, Precision
from kvchat.core.errors import first_line
from kvchat.core.events import EngineError, Reconfigured
from kvchat.core.memory import PRECISIONS, MemorySnapshot
from kvchat.engine.kv.manager import Sequence

log = logging.getLogger("kvchat.engine")
PRESSURE_SLACK = 256 << 20  # short by less (or an eighth of the pool): a module loaded late, not a program
SNAPSHOT_PERIOD = 1.0  # seconds between memory snapshots


class MemoryGovernor:
    def __init__(self, engine):
        self.engine = weakref.proxy(engine)  # the engine owns this: no cycle keeps a closed engine's model alive
        self.next_snapshot = 0.0

    def tick(self, live: list[Sequence] = ()) -> None:
        """About once a second: relieve memory pressure, then tell the listeners where memory goes."""
        e, now = self.engine, time.monotonic()
        if now < self.next_snapshot or e.kvpool is None:
            return
        self.next_snapshot = now + SNAPSHOT_PERIOD
        try:
            total, used = e.probe.totals()
            own = e.probe.own()
        except Exception:  # a probe failing must never stop the engine
            log.exception("memory probe failed")
            return
        other = max(0, used - own)
        # pressure is judged on other programs alone: what the pool gives back may stay in this
        # process's pages for a while, and counting it would shrink the pool again
        self.relieve_pressure(total, other, list(live))
        e.emit(self.snapshot(total, other, own))

    def kv_room(self, total: int, other: int) -> int:
        """Bytes the KV pool may take: what the device has, less everything else and the headroom."""
        e = self.engine
        return total - other - e.weights_bytes - e.activations - e.config.headroom_bytes

    def snapshot(self, total: int, other: int, own: int = 0) -> MemorySnapshot:
        """``own``: this process's bytes; beyond its weights and pool (its runtime) they would
        otherwise pass for free."""
        e = self.engine
        pool = e.kvpool
        usage = pool.usage()
        runtime = max(0, own - e.weights_bytes - usage["kv_total"])
        kv_room = self.kv_room(total, other + runtime)
        free = kv_room + e.config.headroom_bytes - usage["kv_total"]
        room = max(usage["kv_total"], kv_room)  # what the pool could grow to now
        device = e.loaded.device
        return MemorySnapshot(
            device=str(device), total=total, other_processes=other, weights=e.weights_bytes,
            activations_reserve=e.activations, free=max(0, free), precision=pool.precision.value,
            max_context={p.value: pool.tokens_for(p, room) for p in PRECISIONS},
            on_cpu=device.type == "cpu", runtime=runtime, **usage)

    def relieve_pressure(self, total: int, other: int, live: list[Sequence]) -> None:
        """Another process took memory: shrink the pool to give it back, stepping the precision down
        (Auto) so that what is in use still fits. Unreferenced cached blocks go first."""
        e = self.engine
        pool = e.kvpool
        allowed = self.kv_room(total, other)
        if allowed >= pool.budget - min(PRESSURE_SLACK, pool.budget // 8):
            return
        needed = (pool.blocks.num_blocks - pool.blocks.num_free) * pool.block_size
        old = pool.precision
        choice = e.policy.under_pressure(old, lambda p: pool.tokens_for(p, allowed), max(needed, pool.block_size),
                                         e.config.max_context)
        if choice == old and not self.gives_back(choice, allowed):
            pool.budget = allowed  # its bytes (its rings) already fit: nothing to rebuild or to say
            return
        if choice is None:
            return e.notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        try:
            done = self.rebuild(choice, allowed, live)
        except EngineError as error:
            return e.notice("pressure", f"memory is short and the KV cache could not shrink: {error}")
        if not done:
            return e.notice("pressure", "memory is short and the KV cache cannot shrink further right now")
        e.notice("shrink" if choice == old else "downshift",
                 f"another program took memory: KV cache now {allowed / 2**20:.0f} MiB"
                 + (f", {old.value} -> {choice.value}" if choice != old else ""))

    def gives_back(self, precision: Precision, budget: int) -> bool:
        """A pool wholly in rings (every layer windowed) takes their bytes whatever its budget: rebuilt
        to a smaller budget it came back the same size, and said it had shrunk."""
        pool = self.engine.kvpool
        try:
            return pool.nbytes_for(precision, budget) < pool.kv.nbytes
        except ConfigError:  # not one block beside the rings: rebuild says why
            return True

    def rebuild(self, precision: Precision, budget: int, live: list[Sequence] = (),
                local_blocks: int | None = None, span: int | None = None) -> bool:
        """Allocate the new pool, convert, swap, free the old; False when live blocks would not fit.
        Refused up front when the new pool cannot be allocated next to the old; a failure part way
        leaves the old pool as it was (convert.converted is transactional) and raises EngineError."""
        e = self.engine
        pool = e.kvpool
        try:
            new_bytes = pool.nbytes_for(precision, budget, local_blocks, span)
        except ConfigError as error:  # not one block beside the rings
            raise Refused(str(error)) from None
        total, used = e.probe.totals()
        free = total - used
        if new_bytes > free:
            raise Refused(f"the new KV cache needs {new_bytes / 2**20:,.0f} MiB next to the current "
                          f"{pool.kv.nbytes / 2**20:,.0f} MiB, and {max(0, free) / 2**20:,.0f} MiB are free")
        try:
            done = pool.rebuild(precision, budget, live, local_blocks, span)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as error:
            raise EngineError(f"the KV cache could not be rebuilt ({first_line(error)}); it is unchanged") from error
        if done and e.loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        return done

    def control(self, command: Reconfigure) -> None:
        e = self.engine
        try:
            settings = self.reconfigure(command.max_context, command.kv_precision, command.headroom_bytes)
        except Refused as error:
            e.notice("rebuild", f"settings not applied: {error}")
            return command.future.set_exception(error)
        except (ConfigError, ValueError) as error:
            return command.future.set_exception(ConfigError(str(error)))
        except EngineError as error:
            e.notice("rebuild", str(error))
            return command.future.set_exception(error)
        except Exception as error:
            log.exception("reconfigure failed")
            return command.future.set_exception(EngineError(f"reconfigure failed: {error}"))
        command.future.set_result(settings)
        e.emit(Reconfigured(settings))
        e.host.warmed = False  # CUDA: another pool is another captured graph; the CPU's graph serves any pool size

    def reconfigure(self, max_context, kv_precision, headroom_bytes) -> dict:
        """Apply new settings, or leave config and pool exactly as they were."""
        e = self.engine
        cfg, pool = e.config, e.kvpool
        new_cfg = replace(cfg, max_context=max_context or cfg.max_context,
                          kv_precision=kv_precision or cfg.kv_precision,
                          headroom_bytes=cfg.headroom_bytes if headroom_bytes is None else headroom_bytes)
        new_cfg = e.host.capped(new_cfg)
        precision, budget = e.host.layout(new_cfg)
        upward = PRECISIONS.index(precision) < PRECISIONS.index(pool.precision)
        if not self.rebuild(precision, budget, local_blocks=e.host.ring_blocks(new_cfg), span=e.host.span(new_cfg)):
            raise Refused("the KV cache is in use and cannot be rebuilt now")
        if upward:
            pool.clear_cache()  # lossy blocks and rings must not pass for full-precision ones
        e.config, e.policy = new_cfg, e.host.policy(new_cfg)
        self.next_snapshot = 0.0
        return {**e.settings(), "kv_budget": budget}  # the whole config: the app shows it as it is
