"""A remote server's KV-cache state, read from its Prometheus /metrics: vLLM, SGLang, llama-server
(with --metrics) and kvchat serve each name it differently; what none of them gives is None, which
the app shows as "not reported"."""
import math
from dataclasses import dataclass

# per server: (KV-cache usage 0..1, prefix-cache hit rate 0..1, hit counter, query counter)
# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc (v1); both are read.
USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
         "llamacpp:kv_cache_usage_ratio", "kvchat:kv_cache_usage_perc")
HIT_RATE = ("sglang:cache_hit_rate", "vllm:gpu_prefix_cache_hit_rate")
HIT_COUNTERS = (("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
                ("vllm:prefix_cache_hits", "vllm:prefix_cache_queries"),
                ("kvchat:prefix_cache_hits_total", "kvchat:prefix_cache_queries_total"))
RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing",
           "kvchat:requests_running")


@dataclass
class ServerMemory:
    """The server's own figures, labelled as such in the memory panel."""
    server: str | None  # vllm, sglang, llama.cpp, kvchat; None: no /metrics
    kv_usage: float | None = None  # fraction of the server's KV cache in use
    prefix_hit_rate: float | None = None  # fraction of prompt tokens served from its prefix cache
    requests_running: float | None = None


def parse(text: str) -> dict[str, float]:
    """Prometheus text format: each metric summed over its label sets (a vLLM with several models
    or engines reports one line each)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line and "}" in line:
            name, rest = line[:line.index("{")], line[line.rindex("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        if math.isfinite(value):
            values[name] = values.get(name, 0.0) + value
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
    return ServerMemory(server={"llamacpp": "llama.cpp"}.get(server, server), kv_usage=_first(values, USAGE),
                        prefix_hit_rate=rate, requests_running=_first(values, RUNNING))
