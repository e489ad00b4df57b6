"""/metrics for the KV tiers under the pool (host RAM, disk)."""
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def tier_metrics(tiers: dict, tokens: dict):
    """The KV tiers under the pool, labelled by tier: bytes used and capacity (from the last memory
    snapshot), blocks restored, and prompt tokens of finished requests that each tier served."""
    used = GaugeMetricFamily("kvchat:kv_tier_bytes_used", "bytes of KV blocks held in a tier", labels=["tier"])
    cap = GaugeMetricFamily("kvchat:kv_tier_bytes_capacity", "a tier's cap in bytes", labels=["tier"])
    hits = CounterMetricFamily("kvchat:kv_tier_hits", "KV blocks restored from a tier into the pool", labels=["tier"])
    served = CounterMetricFamily("kvchat:kv_tier_prompt_tokens", "prompt tokens a tier served", labels=["tier"])
    for tier in ("ram", "disk"):
        used.add_metric([tier], tiers.get(f"{tier}_used", 0))
        cap.add_metric([tier], tiers.get(f"{tier}_capacity", 0))
        hits.add_metric([tier], tiers.get(f"{tier}_hits", 0))
        served.add_metric([tier], tokens[tier])
    yield from (used, cap, hits, served)
