"""Observability of `ninfer serve`: a request id on every answer (the client's X-Request-Id when valid,
else a fresh one; echoed in the header and in error bodies, 401s and unknown paths included), log lines
(ready, periodic load, request lines at debug with the id), vLLM-named metric aliases, GET /version,
CORS from --allowed-origins only, and the --served-model-name / --synthetic command line."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import ScriptProgram, metric, scripted_engine, wait_until

from ninfer.cli.main import build_parser
from ninfer.cli.main import main as cli_main
from ninfer.cli.serve import serve_config
from ninfer.serve import BackgroundServer, ServeConfig, create_app
from ninfer.targets.open import load_frontend
from ninfer.version import version

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path):  # noqa: ANN201
    return load_frontend(str(tiny_artifact))


def serve(frontend, **config: object) -> BackgroundServer:  # noqa: ANN001
    engine = scripted_engine(ScriptProgram(max_context=256, page_size=16, kv_pages=64), frontend)
    server = BackgroundServer(create_app(engine, ServeConfig(model_name="tiny", **config)))  # type: ignore[arg-type]
    server.start()
    wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, 60)
    return server


@pytest.fixture(scope="module")
def server(frontend) -> Iterator[BackgroundServer]:  # noqa: ANN001
    s = serve(frontend, log_interval_s=0.2)
    yield s
    s.stop()


def test_request_id_echoed_or_generated(server: BackgroundServer) -> None:
    ok = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "trace-42/a"})
    assert ok.status_code == 200 and ok.headers["x-request-id"] == "trace-42/a"
    for bad in ("has spaces", "x" * 129, ""):
        r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"]), r.headers
    fresh = {httpx.get(server.url + "/health").headers["x-request-id"] for _ in range(3)}
    assert len(fresh) == 3
    error = httpx.post(
        server.url + "/v1/chat/completions", json={"messages": []}, headers={"X-Request-Id": "e-1"}
    )
    assert error.status_code == 400 and error.headers["x-request-id"] == "e-1"
    assert error.json()["error"]["request_id"] == "e-1"
    missing = httpx.get(server.url + "/nowhere")
    assert (
        missing.status_code == 404
        and missing.json()["error"]["request_id"] == missing.headers["x-request-id"]
    )
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True},
                      headers={"X-Request-Id": "s-1"}) as stream:  # fmt: skip
        assert stream.headers["x-request-id"] == "s-1"
        assert b"[DONE]" in stream.read()


def test_request_id_on_401(frontend) -> None:  # noqa: ANN001
    s = serve(frontend, api_key="k-1")
    try:
        r = httpx.get(s.url + "/v1/models", headers={"X-Request-Id": "auth-1"})
        assert r.status_code == 401 and r.headers["x-request-id"] == "auth-1"
        assert r.json()["error"]["request_id"] == "auth-1"
    finally:
        s.stop()


def test_log_lines(server: BackgroundServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="ninfer.serve")
    r = httpx.post(server.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "log-7"})
    assert r.status_code == 200
    wait_until(lambda: any(m.startswith("load ") for m in caplog.messages), 10)
    requests = [m for m in caplog.messages if m.startswith("request ") and "id=log-7" in m]
    assert requests and "outcome=length" in requests[0] and "completion_tokens=3" in requests[0]
    load = next(m for m in caplog.messages if m.startswith("load "))
    assert "gen_tok_s=" in load and "running=" in load and "waiting=" in load and "finished=" in load


def test_ready_line(frontend, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    caplog.set_level(logging.INFO, logger="ninfer.serve")
    s = serve(frontend)
    try:
        wait_until(lambda: any(m.startswith("ready ") for m in caplog.messages), 10)
    finally:
        s.stop()
    ready = next(m for m in caplog.messages if m.startswith("ready "))
    assert "model=tiny" in ready and f"version={version()}" in ready and "max_context=256" in ready


def test_vllm_metric_aliases(server: BackgroundServer) -> None:
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    labels = {"model_name": "tiny"}
    assert (
        metric(server.url, "vllm:generation_tokens_total", labels)
        == metric(server.url, "ninfer_generation_tokens_total")
        > 0
    )
    assert metric(server.url, "vllm:prompt_tokens_total", labels) == metric(
        server.url, "ninfer_prompt_tokens_total"
    )
    assert metric(server.url, "vllm:request_success_total", {**labels, "finished_reason": "length"}) >= 1
    assert metric(server.url, "vllm:e2e_request_latency_seconds_count", labels) == metric(
        server.url, "ninfer_e2e_request_latency_seconds_count"
    )
    text = httpx.get(server.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_bucket", "ninfer_kv_cache_usage"):  # fmt: skip
        assert name in text


def test_version(server: BackgroundServer, capsys: pytest.CaptureFixture[str]) -> None:
    assert httpx.get(server.url + "/version").json() == {"version": version()}
    with pytest.raises(SystemExit):
        cli_main(["--version"])
    assert capsys.readouterr().out.strip() == f"ninfer {version()}"


def _preflight(url: str, origin: str) -> httpx.Response:
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type",
    }
    return httpx.options(url + "/v1/chat/completions", headers=headers)


def test_cors(frontend, server: BackgroundServer) -> None:  # noqa: ANN001
    default = _preflight(server.url, ORIGIN)  # no --allowed-origins: no CORS at all
    assert "access-control-allow-origin" not in default.headers
    s = serve(frontend, allowed_origins=(ORIGIN,), api_key="k-2")
    try:
        allowed = _preflight(s.url, ORIGIN)  # no key: a browser's preflight carries none
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
        other = _preflight(s.url, "https://evil.example.com")
        assert "access-control-allow-origin" not in other.headers
        answer = httpx.post(s.url + "/v1/chat/completions", json=CHAT,
                            headers={"Origin": ORIGIN, "Authorization": "Bearer k-2"})  # fmt: skip
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
        assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
    finally:
        s.stop()


def test_served_model_names(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser(only="serve").parse_args(["serve", "--served-model-name", "a", "b"])
    assert args.artifact is None  # "b" is a second name, not the artifact
    config = serve_config(args, "pkg")
    assert config.model_name == "a" and config.model_aliases == ("b",)
    art = tmp_path / "m.ninfer"
    art.write_bytes(b"")
    assert cli_main(["serve", "--served-model-name", "a", str(art)]) == 1
    assert "give ARTIFACT before --served-model-name" in capsys.readouterr().err
    assert cli_main(["serve", "--synthetic", "qwen3_6_nope"]) == 1
    assert "unknown package" in capsys.readouterr().err


def test_model_aliases_answer(frontend) -> None:  # noqa: ANN001
    s = serve(frontend, model_aliases=("b",))
    try:
        assert [m["id"] for m in httpx.get(s.url + "/v1/models").json()["data"]] == ["tiny", "b"]
        r = httpx.post(s.url + "/v1/chat/completions", json={**CHAT, "model": "b"})
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        assert httpx.get(s.url + "/v1/models/b").json()["id"] == "b"
    finally:
        s.stop()
