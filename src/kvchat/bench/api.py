"""kvchat bench api: how the local API serves several clients at once. Concurrent clients each send
short streamed chat requests; requests/s over the whole run and the TTFT each client saw.

Without --remote it starts the API in this process on a free loopback port, on the starter (or
--model); with --remote it measures that server instead (vLLM, llama-server, another kvchat)."""
import asyncio
import json
import socket
import statistics
import sys
import threading
import time

import httpx

from kvchat.remote.client import api_root, list_models

PERSONA = "You are Ada, a patient tutor of mathematics. " * 50  # about 500 tokens
QUESTIONS = ["Name a colour.", "Name a fruit.", "Name an animal.", "Name a city.", "Say hello.",
             "Name a number.", "Name a planet.", "Name a tree."]


def _local_server(model: str, decode: str | None):
    """The API on a free port in a daemon thread; returns its base URL."""
    import uvicorn

    from kvchat.bench.engine import at_full_speed
    from kvchat.core.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.serve.server import create_app
    from kvchat.serve.transport import server_config

    config = EngineConfig(model=model, **({"decode": decode} if decode else {}))
    engine = Engine(config)
    engine.wait_ready()
    at_full_speed(engine)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, engine.loaded.source.label, max_queue=64)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", engine


async def _one(client: httpx.AsyncClient, url: str, model: str | None, i: int, max_tokens: int) -> tuple[float, int]:
    """One streamed request: (TTFT in ms, content chunks received)."""
    body = {"messages": [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} ({i})"}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if model:
        body["model"] = model
    start, first, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", url + "/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                first = first or time.perf_counter()
                chunks += 1
    return ((first or time.perf_counter()) - start) * 1000, chunks


async def _run(url: str, api_key: str | None, model: str | None, clients: int, requests: int, max_tokens: int):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=clients + 1)
    async with httpx.AsyncClient(headers=headers, timeout=600, limits=limits) as client:
        await _one(client, url, model, -1, max_tokens)  # warm-up: a first compile or load is not serving
        todo = iter(range(requests))
        results: list[tuple[float, int]] = []

        async def worker():
            for i in todo:
                results.append(await _one(client, url, model, i, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return results, time.perf_counter() - start


def bench_api(model: str = "starter", remote: str | None = None, api_key: str | None = None,
              remote_model: str | None = None, clients: int = 8, requests: int = 32, max_tokens: int = 16,
              decode: str | None = None) -> dict:
    engine = None
    if remote:
        url, target = api_root(remote), remote
        remote_model = remote_model or list_models(remote, api_key)[0]
    else:
        base, engine = _local_server(model, decode)
        url, target = base + "/v1", f"kvchat serve ({engine.loaded.source.label}, in this process)"
    try:
        results, wall = asyncio.run(_run(url, api_key, remote_model, clients, requests, max_tokens))
        persona = _persona(url, api_key, remote_model)
    finally:
        if engine is not None:
            engine.close()
    ttfts = sorted(t for t, _ in results)
    chunks = sum(c for _, c in results)
    return {"target": target, "clients": clients, "requests": len(results), "max_tokens": max_tokens,
            "seconds": wall, "requests_per_s": len(results) / wall, "chunks_per_s": chunks / wall,
            "ttft_p50_ms": statistics.median(ttfts), "ttft_p95_ms": _percentile(ttfts, 0.95),
            "ttft_max_ms": ttfts[-1], **persona}


def _persona(url: str, api_key: str | None, model: str | None) -> dict:
    """Two conversations with one 500-token persona through the remote backend: the second's
    cached tokens as the server reports them, and the TTFT this side saw for each. A nonce up front
    keeps the first cold on a server that has seen the persona before."""
    from kvchat.core.config import SamplingParams
    from kvchat.core.events import Request
    from kvchat.remote.client import RemoteBackend

    backend = RemoteBackend(url, api_key=api_key, model=model, metrics_period=None)
    backend.wait_ready(60)
    system = {"role": "system", "content": f"[{time.time_ns()}] {PERSONA}"}
    sampling = SamplingParams(max_new_tokens=2, temperature=0)
    cold, warm = (backend.submit(Request(messages=[system, {"role": "user", "content": q}], sampling=sampling)).result(600)
                  for q in ("What is 2 + 2?", "And what is a prime number?"))
    return {"persona_prompt_tokens": warm.stats.prompt_tokens,
            "persona_cached_tokens": warm.stats.cached_tokens if warm.stats.cached_reported else None,
            "persona_cold_ttft_ms": cold.stats.ttft_ms, "persona_warm_ttft_ms": warm.stats.ttft_ms,
            "persona_ttft_ratio": warm.stats.ttft_ms / cold.stats.ttft_ms}


def _percentile(sorted_values: list[float], q: float) -> float:
    """Nearest rank, so that p95 of 32 requests is the 31st, a value that was seen."""
    rank = max(1, -(-int(q * 100) * len(sorted_values) // 100))
    return sorted_values[rank - 1]


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
        return
    r = result
    print(f"bench api: {r['target']}", file=sys.stderr)
    print(f"{r['clients']} concurrent streaming clients, {r['requests']} requests of at most {r['max_tokens']} tokens "
          f"in {r['seconds']:.1f} s")
    print(f"  requests/s   {r['requests_per_s']:.2f}   (streamed chunks/s {r['chunks_per_s']:.1f})")
    print(f"  TTFT p50     {r['ttft_p50_ms']:.0f} ms")
    print(f"  TTFT p95     {r['ttft_p95_ms']:.0f} ms   (max {r['ttft_max_ms']:.0f} ms)")
    cached = "not reported" if r["persona_cached_tokens"] is None else r["persona_cached_tokens"]
    print(f"a 500-token persona through the remote backend: second conversation {cached} of "
          f"{r['persona_prompt_tokens']} prompt tokens cached, TTFT {r['persona_warm_ttft_ms']:.0f} ms against "
          f"{r['persona_cold_ttft_ms']:.0f} ms cold = {r['persona_ttft_ratio']:.2f} (target <= 0.3)")
