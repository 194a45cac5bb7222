"""The context cache through `ninfer serve`, on the bundled demo model (CPU, fp32, greedy), over real HTTP
with the official `openai` client: multi-turn chats reuse their prefix (`cached_tokens`) and answer
exactly what a server with the cache off answers; `X-Session-Id` binds a session and bad ones are
refused; `/metrics` reports the Engine's own cache counters; the reset endpoints need the API key and
empty the cache."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from serve_helpers import MODEL, running_server

from ninfer import Engine, EngineConfig
from ninfer.cli.common import bundled_artifact
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

torch.set_num_threads(1)

TURNS = ["def add(a, b):", "class Stack:", "import os", "def main():", "for i in range(10):"]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
KEY = "test-key-123"
CAPTURE_INTERVAL = 64  # a checkpoint every 64 prompt tokens, so raw prompts are reused too


@functools.cache
def demo_frontend() -> Frontend:
    return load_frontend(bundled_artifact())


def demo_engine(**config: Any) -> Engine:
    settings: dict[str, Any] = dict(
        device="cpu", dtype="float32", max_concurrency=2, queue_capacity=8, cuda_graphs=False, warmup=False
    )
    settings.update(config)
    return Engine(bundled_artifact(), EngineConfig(**settings))


@pytest.fixture(scope="module")
def cached() -> Iterator[tuple[BackgroundServer, Engine]]:
    engine = demo_engine(capture_interval=CAPTURE_INTERVAL)
    with running_server(engine, demo_frontend()) as server:
        yield server, engine


@pytest.fixture(scope="module")
def cold() -> Iterator[BackgroundServer]:
    with running_server(demo_engine(prefix_cache=False), demo_frontend()) as server:
        yield server


def client_of(server: BackgroundServer, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=120)


def chat_turn(
    client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, headers: dict[str, str] | None = None
) -> tuple[str, Any]:
    """(content, usage) of one greedy turn, streamed (usage from include_usage) or not."""
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        extra_body=NO_THINK,
        extra_headers=headers,
    )
    if not stream:
        out = client.chat.completions.create(**args)
        return out.choices[0].message.content or "", out.usage
    content, usage = [], None
    for chunk in client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
    return "".join(content), usage


def conversation(
    client: openai.OpenAI, system: str, stream: bool, headers: dict[str, str] | None = None
) -> list[tuple[str, Any]]:
    """Five turns, each resending the whole conversation, as chat clients do."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    out = []
    for text in TURNS:
        messages.append({"role": "user", "content": text})
        content, usage = chat_turn(client, messages, stream, headers)
        messages.append({"role": "assistant", "content": content})
        out.append((content, usage))
    return out


def scrape(
    server: BackgroundServer, key: str | None = None
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    text = httpx.get(server.url + "/metrics", headers=headers).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_five_turn_chat_reuses_its_prefix_and_answers_as_a_cold_server(
    cached: tuple[BackgroundServer, Engine], cold: BackgroundServer, stream: bool
) -> None:
    server, _ = cached
    system = f"You write Python ({'streamed' if stream else 'whole'})."  # a preamble no other test sent
    warm_turns = conversation(client_of(server), system, stream)
    cold_turns = conversation(client_of(cold), system, stream)
    assert [c for c, _ in warm_turns] == [c for c, _ in cold_turns], "reuse must not change the output"
    assert all(content for content, _ in warm_turns)
    for i, ((_, warm), (_, cold_usage)) in enumerate(zip(warm_turns, cold_turns)):
        assert warm.prompt_tokens == cold_usage.prompt_tokens and warm.completion_tokens == 12
        assert cold_usage.prompt_tokens_details.cached_tokens == 0
        cached_tokens = warm.prompt_tokens_details.cached_tokens
        if i == 0:
            assert cached_tokens == 0, "a preamble nobody sent before cannot be cached"
        else:
            # at least the previous turn's prompt up to its reply start (the template drops nothing here)
            previous = warm_turns[i - 1][1].prompt_tokens
            assert previous - 8 <= cached_tokens < warm.prompt_tokens, (i, cached_tokens, previous)
        details = warm.completion_tokens_details
        assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_completions_reuse_an_identical_prompt_streamed_and_not(
    cached: tuple[BackgroundServer, Engine],
) -> None:
    server, _ = cached
    client = client_of(server)
    prompt = "".join(f"def step_{i}(x):\n    return x + {i}\n\n" for i in range(12))
    args: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    first = client.completions.create(**args)
    again = client.completions.create(**args)
    assert first.choices[0].text == again.choices[0].text
    # a raw prompt has no reuse boundaries: it is captured every CAPTURE_INTERVAL tokens
    n = first.usage.prompt_tokens
    assert n > 2 * CAPTURE_INTERVAL
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // CAPTURE_INTERVAL * CAPTURE_INTERVAL
    chunks = list(client.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first.choices[0].text
    assert usage.prompt_tokens == first.usage.prompt_tokens and usage.completion_tokens == 6
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens


def test_session_header_binds_a_session_and_keeps_the_output(
    cached: tuple[BackgroundServer, Engine], cold: BackgroundServer
) -> None:
    server, engine = cached
    sessions = engine.cache_stats().sessions
    headers = {"X-Session-Id": "conv-7f3a:user@example.com/1"}
    with_session = conversation(client_of(server), "Session test.", False, headers)
    plain = conversation(client_of(cold), "Session test.", False)
    assert [c for c, _ in with_session] == [c for c, _ in plain]
    assert all(u.prompt_tokens_details.cached_tokens > 0 for _, u in with_session[1:])
    assert engine.cache_stats().sessions == sessions + 1, "the session's continuation is bound"
    # completions take the header too
    out = client_of(server).completions.create(
        model=MODEL, prompt="x = 1", max_tokens=2, extra_headers={"X-Session-Id": "completions-1"}
    )
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "value",
    [b"", b"has space", b"x" * 257, "caf\u00e9".encode(), b"semi;colon", b'quote"d'],
    ids=["empty", "space", "too_long", "non_ascii", "semicolon", "quote"],
)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_bad_session_ids_are_refused_naming_the_header(
    cached: tuple[BackgroundServer, Engine], path: str, value: bytes
) -> None:
    server, _ = cached
    body: dict[str, Any] = {"max_tokens": 1}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    response = httpx.post(server.url + path, json=body, headers=[(b"X-Session-Id", value)], timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "X-Session-Id" and "X-Session-Id" in error["message"]
    assert error["code"] == "invalid_request"


def test_per_request_opt_out_header(cached: tuple[BackgroundServer, Engine]) -> None:
    server, engine = cached
    messages = [{"role": "system", "content": "Opt-out test."}, {"role": "user", "content": "def f():"}]
    client = client_of(server)
    chat_turn(client, messages, False)  # leaves checkpoints: the preamble and the reply start
    before = engine.cache_stats()
    _, usage = chat_turn(client, messages, False, {"X-Prefix-Cache": "off"})
    assert usage.prompt_tokens_details.cached_tokens == 0
    after = engine.cache_stats()
    assert (after.queries, after.hits, after.captures) == (before.queries, before.hits, before.captures), (
        "it neither looked, continued nor captured"
    )
    _, usage = chat_turn(client, messages, False, {"X-Prefix-Cache": "on"})
    assert usage.prompt_tokens_details.cached_tokens > 0
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 1},
        headers={"X-Prefix-Cache": "maybe"},
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Prefix-Cache"


def test_metrics_are_the_engines_cache_counters_and_move_with_a_reused_turn(
    cached: tuple[BackgroundServer, Engine],
) -> None:
    server, engine = cached
    before = scrape(server)
    turns = conversation(client_of(server), "Metrics test.", False)[:5]
    after = scrape(server)
    stats = engine.cache_stats()

    def delta(name: str) -> float:
        return after[(name, ())] - before.get((name, ()), 0.0)

    reused = sum(u.prompt_tokens_details.cached_tokens for _, u in turns)
    assert reused > 0
    assert delta("ninfer_prefix_cache_hit_tokens_total") == reused, "each reused token counted once"
    assert delta("ninfer_prefix_cache_hits_total") == sum(
        1 for _, u in turns if u.prompt_tokens_details.cached_tokens
    )
    assert delta("ninfer_prefix_cache_queries_total") == len(turns), "each admission looked once"
    assert delta("ninfer_prefix_cache_captures_total") >= 4
    # the exposition is the Engine's snapshot, not a second count
    assert after[("ninfer_prefix_cache_hit_tokens_total", ())] == stats.hit_tokens
    assert after[("ninfer_prefix_cache_hits_total", ())] == stats.hits
    assert after[("ninfer_prefix_cache_checkpoints", (("tier", "device"),))] == stats.checkpoints > 0
    assert (
        after[("ninfer_prefix_cache_checkpoint_bytes", (("tier", "device"),))] == stats.checkpoint_bytes > 0
    )
    assert after[("ninfer_prefix_cache_enabled", ())] == 1
    assert after[("ninfer_prefix_cache_evictions_total", ())] == stats.evictions
    assert after[("ninfer_prefix_cache_retains_total", ())] == stats.retains
    assert after[("ninfer_prefix_cache_sessions", ())] == stats.sessions
    text = httpx.get(server.url + "/metrics").text
    assert [line.split()[0] for line in text.splitlines() if "hit_tokens" in line and line[0] != "#"] == [
        "ninfer_prefix_cache_hit_tokens_total"
    ], "one series, from the Engine"


def test_cold_server_reports_the_cache_off(cold: BackgroundServer) -> None:
    conversation(client_of(cold), "Cold metrics.", False)
    after = scrape(cold)
    assert after[("ninfer_prefix_cache_enabled", ())] == 0
    assert after[("ninfer_prefix_cache_hits_total", ())] == 0
    assert after[("ninfer_prefix_cache_checkpoints", (("tier", "device"),))] == 0


def test_reset_endpoints_need_the_key_and_empty_the_cache() -> None:
    engine = demo_engine()
    with running_server(engine, demo_frontend(), api_key=KEY) as server:
        client = client_of(server, KEY)
        messages = [{"role": "system", "content": "Reset test."}, {"role": "user", "content": "def g():"}]
        chat_turn(client, messages, False)
        held = engine.cache_stats().checkpoints
        assert held > 0
        for path in ("/reset_prefix_cache", "/flush_cache"):
            missing = httpx.post(server.url + path)
            wrong = httpx.post(server.url + path, headers={"Authorization": "Bearer nope"})
            assert missing.status_code == wrong.status_code == 401
            assert missing.json()["error"]["code"] == "missing_api_key"
            assert wrong.json()["error"]["code"] == "invalid_api_key"
        assert engine.cache_stats().checkpoints == held, "a refused reset dropped nothing"
        auth = {"Authorization": f"Bearer {KEY}"}
        before = scrape(server, KEY)
        response = httpx.post(server.url + "/reset_prefix_cache", headers=auth, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json() == {"object": "prefix_cache.reset", "dropped": held, "checkpoints": 0}
        assert engine.cache_stats().checkpoints == 0
        after = scrape(server, KEY)
        assert (
            after[("ninfer_prefix_cache_evictions_total", ())]
            - before[("ninfer_prefix_cache_evictions_total", ())]
            == held
        )
        assert after[("ninfer_prefix_cache_checkpoint_bytes", (("tier", "device"),))] == 0
        # the effect: the same turn again runs cold
        _, usage = chat_turn(client, messages, False)
        assert usage.prompt_tokens_details.cached_tokens == 0
        # SGLang's name does the same (a body, as curl -d sends one, is ignored)
        flushed = httpx.post(server.url + "/flush_cache", headers=auth, json={}, timeout=60)
        assert flushed.status_code == 200 and flushed.json()["dropped"] > 0
        assert engine.cache_stats().checkpoints == 0
        assert httpx.get(server.url + "/reset_prefix_cache", headers=auth).status_code == 405
        unauthorized = scrape(server, KEY)[
            ("ninfer_requests_total", (("endpoint", "/reset_prefix_cache"), ("outcome", "unauthorized")))
        ]
        assert unauthorized == 2
