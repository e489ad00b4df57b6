"""kvchat bench api: how the API serves several clients at once, side by side in one run.

- the same prompts from 1, 2, 4 ... ``clients`` clients at once, each a streamed request of
  ``max_tokens`` greedy tokens (``ignore_eos``): aggregate decode tok/s and TTFT p50/p95;
- ``clients`` prompts one by one, then all at once: the throughput ratio, and how many of the
  replies came out the same;
- the TTFT of a request sent while ``clients - 1`` others decode, against its TTFT on an idle server;
- two conversations with one 500-token persona through the remote backend.

Without --remote it starts the API in this process on a free loopback port, on the starter (or
--model), and waits until every decode graph it will use is compiled; with --remote it measures
that server instead (llama-server with as many --parallel slots, vLLM, another kvchat)."""
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
TOPICS = ["a lighthouse", "a fox", "the sea", "a city at night", "a robot", "autumn", "a train", "a garden",
          "a storm", "a library", "the moon", "a market", "a mountain", "a river", "a clock", "a bridge"]


def _local_server(model: str, decode: str | None, clients: int):
    """The API on a free port in a daemon thread, its decode step compiled for one sequence and
    for batches of up to ``clients``; returns its base URL and the engine."""
    import uvicorn

    from kvchat.bench.engine import at_full_speed
    from kvchat.core.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.serve.server import create_app
    from kvchat.serve.transport import server_config

    config = EngineConfig(model=model, weights="auto", max_running=clients, **({"decode": decode} if decode else {}))
    engine = Engine(config)
    engine.wait_ready()
    at_full_speed(engine, batch=clients)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = create_app(engine, engine.loaded.source.api_id, max_queue=64)
    server = uvicorn.Server(server_config(app, "127.0.0.1", port))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", engine


def body(i: int, model: str | None, max_tokens: int) -> dict:
    out = {"messages": [{"role": "user", "content": f"Write a story about {TOPICS[i % len(TOPICS)]}."}],
           "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
           "stream_options": {"include_usage": True}}
    return {**out, "model": model} if model else out


async def _one(client: httpx.AsyncClient, url: str, request: dict, started=None) -> dict:
    """One streamed request: its TTFT, its text and its completion tokens."""
    start, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", url + "/chat/completions", json=request) as r:
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
            delta = ((chunk.get("choices") or [{}])[0].get("delta") or {}).get("content")
            if delta:
                if first is None:
                    first = time.perf_counter()
                    if started is not None:
                        started.release()
                text.append(delta)
    return {"ttft_ms": ((first or time.perf_counter()) - start) * 1000, "text": "".join(text), "tokens": tokens}


async def _together(client, url, requests: list[dict]) -> tuple[list[dict], float]:
    start = time.perf_counter()
    replies = await asyncio.gather(*(_one(client, url, r) for r in requests))
    return list(replies), time.perf_counter() - start


async def _one_by_one(client, url, requests: list[dict]) -> tuple[list[dict], float]:
    start, replies = time.perf_counter(), []
    for r in requests:
        replies.append(await _one(client, url, r))
    return replies, time.perf_counter() - start


async def _ttft_under_load(client, url, requests: list[dict], probes: tuple[dict, dict]) -> tuple[float, float]:
    """A probe's TTFT on an idle server, then another's while the others decode (sent once each
    of them has streamed its first token). Two probes of one length: neither finds the other's
    prompt in the prefix cache."""
    idle = (await _one(client, url, probes[0]))["ttft_ms"]
    started = asyncio.Semaphore(0)
    others = [asyncio.ensure_future(_one(client, url, r, started)) for r in requests]
    for _ in others:
        await started.acquire()
    busy = (await _one(client, url, probes[1]))["ttft_ms"]
    await asyncio.gather(*others)
    return idle, busy


async def _run(url: str, api_key: str | None, model: str | None, clients: int, max_tokens: int) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(headers=headers, timeout=900, limits=httpx.Limits(max_connections=clients + 2)) as c:
        requests = [body(i, model, max_tokens) for i in range(clients)]
        await _one(c, url, body(-1, model, 2))  # warm-up: a first load is not serving
        sweep = []
        for n in sorted({1, *(k for k in (2, 4, 8, 16) if k <= clients), clients}):
            replies, wall = await _together(c, url, requests[:n])
            ttfts = sorted(r["ttft_ms"] for r in replies)
            sweep.append({"clients": n, "seconds": wall, "tok_s": sum(r["tokens"] for r in replies) / wall,
                          "ttft_p50_ms": statistics.median(ttfts), "ttft_p95_ms": _percentile(ttfts, 0.95)})
        alone, alone_s = await _one_by_one(c, url, requests)
        together, together_s = await _together(c, url, requests)
        probes = tuple({**body(0, model, max_tokens), "messages": [{"role": "user", "content": f"Describe {thing}."}]}
                       for thing in ("a teacup", "a pencil"))
        idle_ttft, busy_ttft = await _ttft_under_load(c, url, requests[:clients - 1], probes)
    same = sum(a["text"] == b["text"] for a, b in zip(alone, together))
    tokens = sum(r["tokens"] for r in alone)
    return {"sweep": sweep, "one_by_one_s": alone_s, "together_s": together_s,
            "one_by_one_tok_s": tokens / alone_s, "together_tok_s": sum(r["tokens"] for r in together) / together_s,
            "throughput_ratio": alone_s / together_s, "identical_replies": same, "replies": len(alone),
            "idle_ttft_ms": idle_ttft, "loaded_ttft_ms": busy_ttft, "ttft_ratio": busy_ttft / idle_ttft}


def bench_api(model: str = "starter", remote: str | None = None, api_key: str | None = None,
              remote_model: str | None = None, clients: int = 8, max_tokens: int = 64,
              decode: str | None = None) -> dict:
    engine = None
    if remote:
        url, target = api_root(remote), remote
        remote_model = remote_model or list_models(remote, api_key)[0]
    else:
        base, engine = _local_server(model, decode, clients)
        url, target = base + "/v1", f"kvchat serve ({engine.loaded.source.label}, in this process)"
    build = {}
    if engine is not None and engine.loaded.device.type == "cpu":
        from kvchat.bench.engine import cpu_build

        build = {"cpu_build": cpu_build(engine.loaded.model)}
    try:
        result = asyncio.run(_run(url, api_key, remote_model, clients, max_tokens))
        persona = _persona(url, api_key, remote_model)
    finally:
        if engine is not None:
            engine.close()
    return {"target": target, "clients": clients, "max_tokens": max_tokens, **build, **result, **persona}


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
    if r.get("cpu_build"):
        from kvchat.bench.engine import describe_cpu_build

        print(describe_cpu_build(r["cpu_build"]))
    print(f"streamed requests of {r['max_tokens']} greedy tokens, sent at once by N clients")
    print(f"  {'clients':>7}  {'decode tok/s':>12}  {'TTFT p50':>9}  {'TTFT p95':>9}")
    for s in r["sweep"]:
        print(f"  {s['clients']:>7}  {s['tok_s']:>12.1f}  {s['ttft_p50_ms']:>7.0f} ms  {s['ttft_p95_ms']:>7.0f} ms")
    print(f"the same {r['replies']} prompts one by one: {r['one_by_one_s']:.1f} s ({r['one_by_one_tok_s']:.1f} tok/s); "
          f"all at once: {r['together_s']:.1f} s ({r['together_tok_s']:.1f} tok/s) = {r['throughput_ratio']:.2f}x "
          f"(target >= 3); {r['identical_replies']} of {r['replies']} replies identical")
    print(f"TTFT of one more request while {r['clients'] - 1} decode: {r['loaded_ttft_ms']:.0f} ms against "
          f"{r['idle_ttft_ms']:.0f} ms idle = {r['ttft_ratio']:.2f}x (target <= 2)")
    cached = "not reported" if r["persona_cached_tokens"] is None else r["persona_cached_tokens"]
    print(f"a 500-token persona through the remote backend: second conversation {cached} of "
          f"{r['persona_prompt_tokens']} prompt tokens cached, TTFT {r['persona_warm_ttft_ms']:.0f} ms against "
          f"{r['persona_cold_ttft_ms']:.0f} ms cold = {r['persona_ttft_ratio']:.2f} (target <= 0.3)")
