"""A remote server's KV-cache state, read from its Prometheus /metrics: vLLM, SGLang, llama-server
(with --metrics) and kvchat serve each name it differently; what none of them gives is None, which
the app shows as "not reported"."""
import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# The names as the servers' sources write them (vllm/v1/metrics/loggers.py, sglang/srt/metrics/
# collector.py, llama.cpp's server /metrics handler); a Counter declared as "x" is exported as
# "x_total" by prometheus_client.
# KV-cache usage 0..1. vLLM v1 renamed gpu_cache_usage_perc to kv_cache_usage_perc; llama.cpp dropped
# kv_cache_usage_ratio in 2025 (today's builds export no KV usage at all), so only older ones give it.
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
         "llamacpp:kv_cache_usage_ratio", "kvchat:kv_cache_usage_perc")
HIT_RATE = ("sglang:cache_hit_rate", "vllm:gpu_prefix_cache_hit_rate")  # the latter: vLLM v0
HIT_COUNTERS = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
                ("vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_queries_total"),  # early v1
                ("kvchat:prefix_cache_hits_total", "kvchat:prefix_cache_queries_total"))
# llama-server counts the prompt tokens it reused and, apart, those it computed (tools/server/
# server-task.cpp: "prompt_tokens_total": processed, excluding cached tokens)
HIT_PARTS = (("llamacpp:prompt_tokens_cached_total", "llamacpp:prompt_tokens_total"),)
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
           "kvchat:requests_running")
WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred",
           "kvchat:requests_waiting")


@dataclass
class ServerMemory:
    """The server's own figures, labelled as such in the memory panel."""
    server: str | None  # vllm, sglang, llama.cpp, kvchat; None: no /metrics
    kv_usage: float | None = None  # fraction of the server's KV cache in use
    prefix_hit_rate: float | None = None  # fraction of prompt tokens served from its prefix cache
    requests_running: float | None = None
    requests_waiting: float | None = None

    def line(self) -> str:
        """For a terminal: what the server says of its cache, or that it says nothing."""
        if self.server is None:
            return "server metrics: not reported (no /metrics)"
        parts = [f"KV {'not reported' if self.kv_usage is None else f'{self.kv_usage:.0%} used'}",
                 f"prefix hits {'not reported' if self.prefix_hit_rate is None else f'{self.prefix_hit_rate:.0%}'}"]
        for label, value in (("running", self.requests_running), ("waiting", self.requests_waiting)):
            if value is not None:
                parts.append(f"{value:.0f} {label}")
        return f"server ({self.server}): " + ", ".join(parts)


def parse(text: str) -> dict[str, float]:
    """Each sample's value, summed over its label sets (a vLLM with several models or engines reports
    one line each). Read with prometheus_client's parser; what follows a line it cannot read is
    dropped, what came before is kept."""
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if math.isfinite(sample.value):
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except (ValueError, IndexError, KeyError):  # not Prometheus text past this point
        pass
    return values


def _first(values: dict[str, float], names) -> float | None:
    return next((values[n] for n in names if n in values), None)


def server_memory(text: str) -> ServerMemory:
    values = parse(text)
    prefixes = {name.split(":")[0] for name in values if ":" in name}
    server = next((s for s in ("vllm", "sglang", "llamacpp", "kvchat") if s in prefixes), None)
    rate = _first(values, HIT_RATE)
    for hits, queries in HIT_COUNTERS:
        if queries in values:
            rate = values[hits] / values[queries] if values.get(queries) and hits in values else rate
            break
    for cached, computed in HIT_PARTS:
        if cached in values and computed in values:
            total = values[cached] + values[computed]
            rate = values[cached] / total if total else rate
    return ServerMemory(server={"llamacpp": "llama.cpp"}.get(server, server), kv_usage=_first(values, USAGE),
                        prefix_hit_rate=rate, requests_running=_first(values, RUNNING),
                        requests_waiting=_first(values, WAITING))
