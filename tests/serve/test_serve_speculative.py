"""MTP speculative decoding through `ninfer serve` on the bundled demo model (it has an MTP head; CPU,
fp32, greedy): the same content as a plain server, and the drafts in `usage.completion_tokens_details`
and `/metrics` add up to what the Engine drafted."""

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

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli.common import bundled_artifact
from ninfer.serve import BackgroundServer
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

torch.set_num_threads(1)

K = 2
PROMPTS = ["def add(a, b):", "class Stack:\n    def __init__(self):", "import os\n\n\ndef main():"]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


@functools.cache
def demo_frontend() -> Frontend:
    return load_frontend(bundled_artifact())


def demo_engine(speculative: str | None) -> Engine:
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        max_concurrency=2,
        cuda_graphs=False,
        warmup=False,
        speculative=speculative,
    )
    return Engine(bundled_artifact(), config)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, BackgroundServer]]:
    with (
        running_server(demo_engine(f"mtp:{K}"), demo_frontend()) as mtp,
        running_server(demo_engine(None), demo_frontend()) as plain,
    ):
        yield {"mtp": mtp, "plain": plain}


def client_of(server: BackgroundServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server: BackgroundServer) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics").text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


def check_drafts(usage: Any, drafted: float) -> None:
    """accepted + rejected are the drafts the Engine made; the tokens are one per verify round (the
    corrected or bonus token) plus the accepted drafts, the first one from the prefill, the last round
    possibly cut by max_tokens."""
    details = usage.completion_tokens_details
    accepted, rejected = details.accepted_prediction_tokens, details.rejected_prediction_tokens
    assert accepted + rejected == drafted > 0 and accepted >= 0 and rejected >= 0
    assert drafted % K == 0
    rounds = drafted // K
    assert rounds + accepted <= usage.completion_tokens <= 1 + rounds + accepted


@pytest.mark.parametrize("prompt", PROMPTS)
def test_chat_with_mtp_answers_as_plain_decoding(servers: dict[str, BackgroundServer], prompt: str) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=16,
        temperature=0,
        extra_body=NO_THINK,
    )
    before = metrics(servers["mtp"])
    fast = client_of(servers["mtp"]).chat.completions.create(**args)
    after = metrics(servers["mtp"])
    plain = client_of(servers["plain"]).chat.completions.create(**args)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    drafted = after["ninfer_spec_decode_draft_tokens_total"] - before["ninfer_spec_decode_draft_tokens_total"]
    check_drafts(fast.usage, drafted)
    accepted = (
        after["ninfer_spec_decode_accepted_tokens_total"] - before["ninfer_spec_decode_accepted_tokens_total"]
    )
    assert accepted == fast.usage.completion_tokens_details.accepted_prediction_tokens
    details = plain.usage.completion_tokens_details
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (0, 0)


def test_streamed_completions_with_mtp_answer_as_plain_decoding(servers: dict[str, BackgroundServer]) -> None:
    args: dict[str, Any] = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=20, temperature=0)
    before = metrics(servers["mtp"])
    chunks = list(
        client_of(servers["mtp"]).completions.create(
            **args, stream=True, stream_options={"include_usage": True}
        )
    )
    after = metrics(servers["mtp"])
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    plain = client_of(servers["plain"]).completions.create(**args)
    assert text == plain.choices[0].text
    usage = chunks[-1].usage
    assert usage.completion_tokens == plain.usage.completion_tokens == 20
    check_drafts(
        usage,
        after["ninfer_spec_decode_draft_tokens_total"] - before["ninfer_spec_decode_draft_tokens_total"],
    )


def test_mean_accepted_length_is_one_plus_accepted_per_round(servers: dict[str, BackgroundServer]) -> None:
    client_of(servers["mtp"]).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    m = metrics(servers["mtp"])
    drafted, accepted = (
        m["ninfer_spec_decode_draft_tokens_total"],
        m["ninfer_spec_decode_accepted_tokens_total"],
    )
    rounds = m["ninfer_spec_decode_verify_rounds_total"]
    assert rounds == drafted / K > 0
    assert m["ninfer_spec_decode_mean_accepted_length"] == pytest.approx(1 + accepted / rounds)
    assert 1 <= m["ninfer_spec_decode_mean_accepted_length"] <= K + 1
    text = httpx.get(servers["mtp"].url + "/metrics").text
    by_position = {
        int(s.labels["position"]): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "ninfer_spec_decode_accepted_by_position_total"
    }
    assert sorted(by_position) == list(range(1, K + 1))  # a round keeps a prefix of its drafts
    assert sum(by_position.values()) == accepted
    assert all(by_position[p] >= by_position[p + 1] for p in range(1, K)) and by_position[1] <= rounds
    plain = metrics(servers["plain"])
    assert (
        plain["ninfer_spec_decode_draft_tokens_total"] == plain["ninfer_spec_decode_verify_rounds_total"] == 0
    )
    assert plain["ninfer_spec_decode_mean_accepted_length"] == 0


def test_mtp_and_the_prefix_cache_together(servers: dict[str, BackgroundServer]) -> None:
    """A second turn on the MTP server reuses the first's prefix and still answers as plain decoding."""
    outs = {}
    for name, server in servers.items():
        client = client_of(server)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "def first():"}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINK
        )
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": "def second():"},
        ]
        second = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body=NO_THINK
        )
        assert second.usage.prompt_tokens_details.cached_tokens > 0
        outs[name] = (first.choices[0].message.content, second.choices[0].message.content)
    assert outs["mtp"] == outs["plain"]


def test_served_drafts_are_the_engines_own(servers: dict[str, BackgroundServer]) -> None:
    """The same greedy request through Engine.generate drafts and accepts exactly what the server
    reports (MTP drafts are greedy and the CPU fp32 run is deterministic)."""
    served = client_of(servers["mtp"]).completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0
    )
    engine = demo_engine(f"mtp:{K}")
    try:
        result = engine.generate(GenerationRequest(prompt=PROMPTS[1], max_tokens=12, temperature=0))
    finally:
        engine.close()
    details = served.usage.completion_tokens_details
    assert result.text == served.choices[0].text
    assert details.accepted_prediction_tokens == result.usage.accepted_draft_tokens
    assert (
        details.rejected_prediction_tokens == result.usage.drafted_tokens - result.usage.accepted_draft_tokens
    )
    assert result.usage.drafted_tokens > 0
