"""What /metrics reports: the server's own counters, and the KV figures of the engine's last
memory snapshot, in Prometheus' text format through prometheus_client."""
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvchat.core.events import Finished
from kvchat.core.memory import MemorySnapshot
from kvchat.serve.tier_metrics import tier_metrics


class Counters:
    """What /metrics reports and the queue bound reads; touched only on the event loop."""

    def __init__(self):
        self.active = self.finished = self.prompt_tokens = self.cached_tokens = self.refused = 0
        self.running = 0  # of the active, those the engine has begun (their first event came)
        self.tier_tokens = {"ram": 0, "disk": 0}  # of cached_tokens, those restored from a tier
        self.cancelled = 0  # ended before their last event because the client left

    def count(self, event: Finished) -> None:
        self.finished += 1
        self.prompt_tokens += event.stats.prompt_tokens
        self.cached_tokens += event.stats.cached_tokens
        self.tier_tokens["ram"] += event.stats.ram_tokens
        self.tier_tokens["disk"] += event.stats.disk_tokens


class MetricsCollector:
    """kvchat's own names, in the shape of vLLM's: the remote client reads either. Read when
    /metrics is asked: the counters, and the KV figures of the engine's last memory snapshot (about
    once a second). A counter named "x" is exported as "x_total", as prometheus_client does."""

    def __init__(self, state, counters: Counters):
        self.state, self.counters = state, counters

    def collect(self):
        snapshot: MemorySnapshot | None = self.state.snapshot
        c = self.counters
        total, in_use = (snapshot.kv_total, snapshot.kv_in_use) if snapshot else (0, 0)
        yield GaugeMetricFamily("kvchat:kv_cache_usage_perc", "KV-cache blocks in use, 1 means full",
                                value=in_use / total if total else 0.0)
        yield GaugeMetricFamily("kvchat:kv_bytes_in_use", "bytes of KV-cache blocks referenced by a running request",
                                value=in_use)
        yield CounterMetricFamily("kvchat:prefix_cache_queries", "prompt tokens of finished requests",
                                  value=c.prompt_tokens)
        yield CounterMetricFamily("kvchat:prefix_cache_hits", "of those, tokens served from the cache",
                                  value=c.cached_tokens)
        yield from tier_metrics(snapshot.tiers if snapshot else {}, c.tier_tokens)
        yield GaugeMetricFamily("kvchat:requests_running", "requests the engine runs now, together", value=c.running)
        yield GaugeMetricFamily("kvchat:requests_waiting", "requests submitted, waiting to run",
                                value=c.active - c.running)
        yield CounterMetricFamily("kvchat:requests_refused", "requests refused with 429", value=c.refused)
        yield CounterMetricFamily("kvchat:requests_cancelled", "requests cancelled by a client that left",
                                  value=c.cancelled)
