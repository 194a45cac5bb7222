"""Overload (429 + Retry-After, nothing lost or duplicated), client disconnects (the lane comes back
within one decode round, seen through /metrics), queue timeouts (503), Engine failure (503 and /ready
false), loading (/ready 503 until the Engine is ready) and the API key (401)."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from serve_helpers import MODEL, ScriptProgram, metric, running_server, scripted_engine, wait_until

from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

UNIT_S = 0.05  # scripted execution unit time: long enough that requests overlap


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Frontend:
    return frontend_of(str(tiny_artifact))


def _completion_body(seed: int, max_tokens: int = 6) -> dict[str, Any]:
    return {"model": MODEL, "prompt": f"request {seed}", "max_tokens": max_tokens, "seed": seed}


def test_overload_gives_429_and_loses_nothing(frontend: Frontend) -> None:
    program = ScriptProgram(max_concurrency=1, unit_sleep_s=UNIT_S)
    go = threading.Event()  # no execution unit runs before every refusal is in: no lane frees meanwhile
    program.on_execute = lambda kind, handles: go.wait(60)
    engine = scripted_engine(program, frontend, max_concurrency=1, queue_capacity=1)
    baseline = program.usage()
    with running_server(engine, frontend) as server:

        async def burst() -> list[tuple[int, Any]]:
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)

            async def one(seed: int) -> tuple[int, Any]:
                try:
                    return seed, await client.completions.create(**_completion_body(seed))
                except openai.RateLimitError as exc:
                    return seed, exc

            tasks = [asyncio.create_task(one(seed)) for seed in range(20)]
            refused = 0
            for finished in asyncio.as_completed(tasks):
                _, out = await finished
                refused += isinstance(out, openai.RateLimitError)
                if refused == 18:
                    # capacity 2 (1 active + 1 queued): the other 18 were refused while both still held
                    # their places, i.e. at once, without waiting for a lane
                    go.set()
            go.set()
            results = [task.result() for task in tasks]
            await client.close()
            return results

        results = asyncio.run(burst())
        rejected = [(s, r) for s, r in results if isinstance(r, openai.RateLimitError)]
        accepted = [(s, r) for s, r in results if not isinstance(r, openai.RateLimitError)]
        assert len(rejected) == 18 and len(accepted) == 2, "capacity 2 (1 active + 1 queued) of 20"
        for _, exc in rejected:
            assert exc.status_code == 429 and int(exc.response.headers["retry-after"]) >= 1
            assert exc.body["code"] == "queue_full" and "queue_capacity" in exc.body["message"]
        # every accepted request completed with its own output (checked against a lone rerun of its seed)
        assert len({r.id for _, r in accepted}) == len(accepted)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=30)
        for seed, out in accepted:
            assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 6
            assert out.choices[0].text == client.completions.create(**_completion_body(seed)).choices[0].text
        assert metric(server.url, "ninfer_requests_total", {"outcome": "queue_full"}) == len(rejected)
        assert metric(server.url, "ninfer_requests_total", {"outcome": "length"}) == 2 * len(accepted)
        assert (
            metric(server.url, "ninfer_queue_depth") == 0 and metric(server.url, "ninfer_active_lanes") == 0
        )
        completed = 2 * len(accepted)  # the burst's accepted requests and their reruns
        prompt_tokens = 2 * sum(out.usage.prompt_tokens for _, out in accepted)
        assert metric(server.url, "ninfer_generation_tokens_total") == 6 * completed
        assert metric(server.url, "ninfer_prompt_tokens_total") == prompt_tokens
        assert metric(server.url, "ninfer_time_to_first_token_seconds_count") == completed
        assert metric(server.url, "ninfer_time_per_output_token_seconds_count") == completed
        assert metric(server.url, "ninfer_e2e_request_latency_seconds_count") == completed + len(rejected)
        stats = engine.cache_stats()  # the cache's counters are the Engine's own, not the gateway's
        assert metric(server.url, "ninfer_prefix_cache_queries_total") == stats.queries
        assert metric(server.url, "ninfer_prefix_cache_hits_total") == stats.hits
    assert program.usage() == baseline


def test_disconnect_frees_the_lane_within_one_decode_round(frontend: Frontend) -> None:
    program = ScriptProgram(max_concurrency=1, unit_sleep_s=0.1, max_context=512, kv_pages=128)
    engine = scripted_engine(program, frontend, max_concurrency=1, queue_capacity=2)
    baseline = program.usage()
    with running_server(engine, frontend) as server:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": 400,
            "stream": True,
        }
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()  # held: dropping a half-read iterator closes the response
            events = 0
            for line in lines:
                events += line.startswith("data: ")
                if events == 4:
                    break
            assert metric(server.url, "ninfer_active_lanes") == 1
            closed_at = time.monotonic()
            lines.close()
        # the connection is closed: the request must be cancelled at the next worker boundary
        wait_until(lambda: metric(server.url, "ninfer_active_lanes") == 0, timeout=120)
        decodes_after = [t for kind, t in program.unit_log if kind == "decode" and t > closed_at]
        assert len(decodes_after) <= 1, "at most the decode round in flight at the disconnect ran"
        assert len(program.release_log) == 1 and program.release_log[0] > closed_at
        assert metric(server.url, "ninfer_requests_total", {"outcome": "cancelled"}) == 1
        # the freed lane serves the next request at once
        quick = httpx.post(server.url + "/v1/completions", json=_completion_body(1, 2), timeout=30)
        assert quick.status_code == 200
    assert program.usage() == baseline


def test_non_streaming_disconnect_cancels(frontend: Frontend) -> None:
    program = ScriptProgram(max_concurrency=1, unit_sleep_s=0.05, max_context=512, kv_pages=128)
    engine = scripted_engine(program, frontend, max_concurrency=1)
    with running_server(engine, frontend) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=_completion_body(3, 300), timeout=0.5)
        wait_until(
            lambda: metric(server.url, "ninfer_requests_total", {"outcome": "cancelled"}) == 1, timeout=5
        )
        assert metric(server.url, "ninfer_active_lanes") == 0
        assert len(program.unit_log) < 40, "cancelled long before its 300 tokens"


def test_queue_timeout_is_503(frontend: Frontend) -> None:
    program = ScriptProgram(max_concurrency=1, unit_sleep_s=UNIT_S)
    engine = scripted_engine(program, frontend, max_concurrency=1, queue_capacity=4, queue_timeout_s=0.2)
    with running_server(engine, frontend) as server:

        async def two() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                # the slow request holds the one lane before the late one is sent
                slow = asyncio.create_task(client.post("/v1/completions", json=_completion_body(1, 16)))
                await asyncio.to_thread(
                    wait_until, lambda: metric(server.url, "ninfer_active_lanes") == 1, timeout=5
                )
                late = client.post("/v1/completions", json=_completion_body(2, 2))
                return list(await asyncio.gather(slow, late))

        slow, late = asyncio.run(two())
        assert slow.status_code == 200
        assert late.status_code == 503 and late.headers["retry-after"]
        assert late.json()["error"]["code"] == "queue_timeout"


def test_engine_failure_is_503_and_not_ready(frontend: Frontend) -> None:
    program = ScriptProgram(faults={"decode": 1})
    with running_server(scripted_engine(program, frontend), frontend) as server:
        failed = httpx.post(server.url + "/v1/completions", json=_completion_body(1), timeout=30)
        assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_failed"
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "failed"
        again = httpx.post(
            server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert again.status_code == 503 and "restart" in again.json()["error"]["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        assert metric(server.url, "ninfer_engine_ready") == 0


def test_ready_only_after_loading(frontend: Frontend) -> None:
    release = threading.Event()

    def load() -> Any:
        release.wait(30)
        return scripted_engine(ScriptProgram(), frontend)

    with running_server(load, frontend, wait_ready=False) as server:
        assert httpx.get(server.url + "/health").status_code == 200
        loading = httpx.get(server.url + "/ready")
        assert loading.status_code == 503 and loading.json()["status"] == "loading"
        early = httpx.post(server.url + "/v1/completions", json=_completion_body(1))
        assert early.status_code == 503 and early.headers["retry-after"]
        release.set()
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, timeout=120)
        assert (
            httpx.post(server.url + "/v1/completions", json=_completion_body(1), timeout=30).status_code
            == 200
        )


def test_api_key(frontend: Frontend) -> None:
    with running_server(scripted_engine(ScriptProgram(), frontend), frontend, api_key="s3cret") as server:
        url = server.url + "/v1/completions"
        missing = httpx.post(url, json=_completion_body(1))
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        wrong = httpx.post(url, json=_completion_body(1), headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        bad_json = httpx.post(url, content=b"{", headers={"content-type": "application/json"})
        assert bad_json.status_code == 401, "the key is checked before the body"
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert client.completions.create(**_completion_body(1)).usage.completion_tokens == 6
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        for probe in ("/health", "/ready"):
            assert httpx.get(server.url + probe).status_code == 200
        for closed in ("/metrics", "/docs", "/openapi.json"):  # only the probes are open by default
            assert httpx.get(server.url + closed).status_code == 401
            authorized = httpx.get(server.url + closed, headers={"Authorization": "Bearer s3cret"})
            assert authorized.status_code == 200
        assert httpx.post(server.url + "/tokenize", json={"prompt": "x"}).status_code == 401
