"""A bounded soak: a few hundred mixed requests (chat and completions, streamed and not, batches, streams
the client abandons half-read, requests it gives up on, bad requests, tokenizer calls) from many
concurrent clients. Afterwards the gauges are back to zero, nothing was an internal error or a 5xx,
and the Program's accounting is back to its baseline."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
from serve_helpers import ScriptProgram, metric, running_server, scripted_engine, wait_until

from ninfer.targets.open import load_frontend

REQUESTS = 300
CLIENTS = 16
HANG_GUARD_S = 300.0


async def one(client: httpx.AsyncClient, rnd: random.Random, i: int) -> list[int]:
    """One request of a random kind; the statuses it saw (an abandoned stream has none)."""
    user = {"role": "user", "content": f"request {i}"}
    kind = rnd.choice(["chat", "stream", "abandon", "completion", "batch", "give_up", "bad", "tokenize"])
    if kind == "chat":
        body = {"messages": [user], "max_tokens": rnd.randint(1, 8), "seed": i}
        return [(await client.post("/v1/chat/completions", json=body)).status_code]
    if kind in ("stream", "abandon"):
        body = {"messages": [user], "max_tokens": 24, "stream": True, "seed": i}
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            status = response.status_code
            async for line in response.aiter_lines():
                if kind == "abandon" and line.startswith("data: "):
                    break  # closes the connection mid-stream: the server cancels the request
        return [status]
    if kind == "completion":
        body = {"prompt": f"text {i}", "max_tokens": rnd.randint(1, 8), "logprobs": 1}
        return [(await client.post("/v1/completions", json=body)).status_code]
    if kind == "batch":
        body = {"prompt": [f"a {i}", [1, 2, 3], f"b {i}"], "max_tokens": 3, "seed": i}
        return [(await client.post("/v1/completions", json=body)).status_code]
    if kind == "give_up":
        body = {"prompt": f"long {i}", "max_tokens": 200}
        try:
            await asyncio.wait_for(client.post("/v1/completions", json=body), timeout=rnd.uniform(0.01, 0.2))
        except TimeoutError:
            return []  # the client went away; the server cancels (or it finished in time)
        return []
    if kind == "bad":
        body = rnd.choice([{"messages": []}, {"prompt": [10**9]}, {"prompt": "x", "temperature": -1}])
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        return [(await client.post(path, json=body)).status_code]
    return [(await client.post("/tokenize", json={"prompt": f"tokens {i}"})).status_code]


def test_bounded_soak_returns_to_zero(tiny_artifact: Path) -> None:
    frontend = load_frontend(str(tiny_artifact))
    program = ScriptProgram(max_concurrency=4, max_context=256, page_size=16, kv_pages=128)
    engine = scripted_engine(program, frontend, max_concurrency=4, queue_capacity=512)
    baseline = program.usage()
    with running_server(engine, frontend) as server:

        async def soak() -> list[int]:
            rnd = random.Random(1234)
            limits = httpx.Limits(max_connections=CLIENTS)
            async with httpx.AsyncClient(base_url=server.url, timeout=HANG_GUARD_S, limits=limits) as client:
                gate = asyncio.Semaphore(CLIENTS)

                async def gated(i: int) -> list[int]:
                    async with gate:
                        return await one(client, random.Random(rnd.random()), i)

                results = await asyncio.gather(*(gated(i) for i in range(REQUESTS)))
            return [status for statuses in results for status in statuses]

        statuses = asyncio.run(soak())
        assert statuses and all(s in (200, 400) for s in statuses), sorted(set(statuses))
        assert statuses.count(200) > REQUESTS // 2
        # abandoned requests finish draining in the background: wait for the gauges, then check them
        wait_until(
            lambda: (
                metric(server.url, "ninfer_active_lanes") == 0
                and metric(server.url, "ninfer_queue_depth") == 0
            ),
            HANG_GUARD_S,
        )
        for outcome in ("error", "engine_failed", "engine_unavailable", "queue_full", "queue_timeout"):
            assert metric(server.url, "ninfer_requests_total", {"outcome": outcome}) == 0, outcome
        assert metric(server.url, "ninfer_requests_total", {"outcome": "cancelled"}) > 0
        assert httpx.get(server.url + "/ready").status_code == 200
    assert program.usage() == baseline
