"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis): at least 500
generated requests, valid and invalid, across every operation; none may get a 5xx or hang, and the
server must end healthy with every lane and page back."""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from serve_helpers import ScriptProgram, metric, running_server, scripted_engine, wait_until

from ninfer.serve import create_app
from ninfer.serve.gateway import ServeConfig
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

EXAMPLES = 500
CALL_TIMEOUT_S = 20  # a request taking longer counts as a hang
MAX_CONTEXT = 64  # keeps every accepted generation short: the server's own limit caps max_tokens


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


def reach_engine(case: schemathesis.Case) -> schemathesis.Case:
    """A valid case minus the most common early refusals (unknown model name, n > 1, media parts, a chat
    without a user turn), so more requests run through the Engine and the output pipeline."""
    body = case.body
    if isinstance(body, dict):
        body.pop("model", None)
        body.pop("n", None)
        if isinstance(body.get("messages"), list):
            for message in body["messages"]:
                if isinstance(message, dict) and isinstance(message.get("content"), list):
                    message["content"] = [p for p in message["content"] if p.get("type") == "text"] or "text"
            body["messages"].append({"role": "user", "content": "hello"})
    return case


def test_fuzz_no_5xx_no_hang(tiny_artifact: Path) -> None:
    frontend = frontend_of(str(tiny_artifact))
    program = ScriptProgram(max_concurrency=2, max_context=MAX_CONTEXT, page_size=8, kv_pages=32)
    engine = scripted_engine(program, frontend, queue_capacity=4, max_context=MAX_CONTEXT)
    baseline = program.usage()
    schema_doc = create_app(engine, ServeConfig(model_name="schema-only")).openapi()
    schema = schemathesis.openapi.from_dict(schema_doc)
    positive = schema.as_strategy(generation_mode=GenerationMode.POSITIVE)
    deep = positive.map(reach_engine)
    cases = st.one_of(
        positive,
        deep,
        deep,
        schema.as_strategy(generation_mode=GenerationMode.NEGATIVE),
    )
    statuses: Counter[int] = Counter()
    operations: Counter[str] = Counter()

    with running_server(engine, frontend) as server, requests.Session() as session:

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases)
        def run(case: schemathesis.Case) -> None:
            response = case.call(base_url=server.url, session=session, timeout=CALL_TIMEOUT_S)
            statuses[response.status_code] += 1
            operations[f"{case.method} {case.path}"] += 1
            assert response.status_code < 500, (
                f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}\n"
                f"body: {case.body!r}"
            )
            if response.status_code >= 400:  # every error is in the OpenAI shape
                assert set(response.json()["error"]) >= {"message", "type", "code"}

        run()
        assert sum(statuses.values()) >= EXAMPLES
        assert statuses[200] >= EXAMPLES // 10 and statuses[400] > 0, statuses
        assert len(operations) >= 8, operations
        assert httpx.get(server.url + "/ready").status_code == 200
        wait_until(lambda: metric(server.url, "ninfer_active_lanes") == 0, timeout=120)
        assert metric(server.url, "ninfer_queue_depth") == 0
    assert program.usage() == baseline
