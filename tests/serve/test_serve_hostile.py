"""The hardening issue's hostile set (``hostile_cases.py``) against a real server: every case gets its
4xx (never a 5xx, never a hang) and the server is healthy after each; slow senders are cut off, the body
limit answers before a byte is parsed, the connection cap holds, and blank API keys cannot start a server.

No assertion here depends on how fast the machine is: waits are events or generous hang guards.
"""

from __future__ import annotations

import functools
import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hostile_cases import Case, hostile_cases, nested_object
from serve_helpers import MODEL, ScriptProgram, metric, scripted_engine, wait_until

from ninfer.serve import BackgroundServer, ServeConfig, create_app
from ninfer.serve.limits import RequestLimits
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

HANG_GUARD_S = 300.0  # a request that takes this long is hung, however loaded the machine
JSON = {"content-type": "application/json"}


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


@pytest.fixture(scope="module")
def frontend(tiny_artifact: Path) -> Frontend:
    return frontend_of(str(tiny_artifact))


def serve(frontend: Frontend, limits: RequestLimits | None = None, **config: object) -> BackgroundServer:
    program = ScriptProgram(max_concurrency=2, max_context=256, page_size=16, kv_pages=64)
    engine = scripted_engine(program, frontend, max_concurrency=2, queue_capacity=8)
    settings = ServeConfig(model_name=MODEL, limits=limits or RequestLimits(), **config)  # type: ignore[arg-type]
    server = BackgroundServer(create_app(engine, settings, frontend=frontend))
    server.start()
    return server


@pytest.fixture(scope="module")
def server(frontend: Frontend) -> Iterator[BackgroundServer]:
    running = serve(frontend)
    try:
        yield running
    finally:
        running.stop()


CASES = hostile_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_case(case: Case, server: BackgroundServer) -> None:
    with httpx.Client(base_url=server.url, timeout=HANG_GUARD_S) as client:
        response = client.post(case.path, content=case.body(), headers=JSON)
        assert response.status_code in case.statuses, (response.status_code, response.text[:300])
        error = response.json()["error"]
        assert error["message"] and error["type"], error
        if case.param is not None:
            assert error["param"] == case.param, error
        assert client.get("/health").status_code == 200
        assert client.get("/ready").status_code == 200


def test_server_is_clean_after_the_hostile_set(server: BackgroundServer) -> None:
    """After every case ran (module order): nothing was an internal error, no request holds a lane."""
    assert metric(server.url, "ninfer_requests_total", {"outcome": "error"}) == 0
    assert metric(server.url, "ninfer_active_lanes") == 0 and metric(server.url, "ninfer_queue_depth") == 0
    quick = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 2


# ---- limits: which side of each bound ----------------------------------------------------------------


def test_json_limits_name_the_field_and_stop_exactly_at_the_bound(frontend: Frontend) -> None:
    limits = RequestLimits(max_json_depth=8, max_items=10, max_containers=20, max_body_bytes=4000)
    server = serve(frontend, limits)
    try:
        post = functools.partial(httpx.post, server.url + "/v1/chat/completions", headers=JSON, timeout=60)
        user = [{"role": "user", "content": "hi"}]

        def chat(**fields: object) -> httpx.Response:
            return post(content=json.dumps({"messages": user, "max_tokens": 2, **fields}))

        # the body is depth 1, chat_template_kwargs 2, its "x" 3: 6 nested objects inside reach depth 8
        fits = chat(chat_template_kwargs={"x": json.loads(nested_object(6))})
        assert fits.status_code == 200, fits.text
        deep = chat(chat_template_kwargs={"x": json.loads(nested_object(7))})
        assert deep.status_code == 400 and "nested deeper than 8 levels" in deep.json()["error"]["message"]
        assert deep.json()["error"]["param"].startswith("chat_template_kwargs.x.x")
        many = chat(stop=list("abcdefghijk"))
        assert many.status_code == 400 and many.json()["error"]["param"] == "stop"
        assert "11 entries, more than the 10" in many.json()["error"]["message"]
        assert chat(stop=list("abcdefghij")).status_code == 200
        tool = {"type": "function", "function": {"name": "f", "parameters": {k: {} for k in "abcdef"}}}
        body = {"messages": [{"role": "user", "content": "a"}] * 10, "tools": [tool]}  # 22 containers
        containers = post(content=json.dumps(body))
        assert containers.status_code == 400
        assert "22 objects and lists, more than 20" in containers.json()["error"]["message"]
        # brackets and commas inside strings are text, not structure: this counts as 4 containers
        brackets = post(
            content=json.dumps({"messages": [{"role": "user", "content": "[{," * 30}], "max_tokens": 1})
        )
        assert brackets.status_code == 200, brackets.text
        head = b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1'
        exactly = head + b" " * (4000 - len(head) - 1) + b"}"  # JSON whitespace up to the limit
        assert len(exactly) == 4000 and post(content=exactly).status_code == 200
        over = post(content=head + b" " * (4001 - len(head) - 1) + b"}")
        assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"
        assert "limit of 4000 bytes" in over.json()["error"]["message"]
    finally:
        server.stop()


def raw_request(server: BackgroundServer) -> socket.socket:
    sock = socket.create_connection((server.host, server.port), timeout=HANG_GUARD_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    while chunk := sock.recv(65536):
        out += chunk
    return out


def test_body_limit_answers_from_the_headers(frontend: Frontend) -> None:
    """A Content-Length over the limit gets 413 before any body byte is sent (so none was parsed)."""
    server = serve(frontend)
    try:
        with raw_request(server) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (200 << 20)
            )
            head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 413 ") and b"body_too_large" in head
    finally:
        server.stop()


def test_slow_senders_are_cut_off(frontend: Frontend) -> None:
    """Silent connections and header or body senders slower than the deadlines are closed (408 for a
    body), while /health answers throughout."""
    limits = RequestLimits(header_timeout_s=0.5, body_timeout_s=0.5)
    server = serve(frontend, limits)
    try:
        with raw_request(server) as silent:
            assert read_all(silent) == b""  # closed by the server: nothing was ever sent
        head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 20
        with raw_request(server) as dripping:
            sent = 0
            try:
                for byte in head:
                    dripping.sendall(bytes([byte]))
                    sent += 1
                    if dripping.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                        break
                    assert httpx.get(server.url + "/health", timeout=HANG_GUARD_S).status_code == 200
            except (BlockingIOError, InterruptedError):
                pass
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert sent < len(head), "the headers never completed, yet the connection stayed open"
        with raw_request(server) as slow_body:
            slow_body.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000\r\n\r\n{"
            )
            answer = read_all(slow_body)
        assert answer.startswith(b"HTTP/1.1 408 ") and b"request_timeout" in answer
        assert httpx.get(server.url + "/health", timeout=HANG_GUARD_S).status_code == 200
    finally:
        server.stop()


def test_connection_cap(frontend: Frontend) -> None:
    """Beyond ``max_connections`` open connections a request gets uvicorn's 503; once they close, the
    server answers again (the idle ones are closed by the header deadline, here never reached)."""
    server = serve(frontend, RequestLimits(max_connections=4))
    try:
        idle = [raw_request(server) for _ in range(4)]
        refused = httpx.get(server.url + "/health", timeout=HANG_GUARD_S)
        assert refused.status_code == 503
        for sock in idle:
            sock.close()
        wait_until(lambda: httpx.get(server.url + "/health").status_code == 200, HANG_GUARD_S)
    finally:
        server.stop()


# ---- authentication ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", " ", "\t\n", "two words", "caf\u00e9", "key\x00"])
def test_unusable_api_keys_cannot_start_a_server(key: str) -> None:
    with pytest.raises(ValueError, match="API key"):
        ServeConfig(model_name=MODEL, api_key=key)


def test_open_paths_are_the_probes_and_metrics_on_request(frontend: Frontend) -> None:
    for public_metrics, metrics_status in ((False, 401), (True, 200)):
        server = serve(frontend, api_key="k3y", public_metrics=public_metrics)
        try:
            for path, status in (
                ("/health", 200),
                ("/ready", 200),
                ("/metrics", metrics_status),
                ("/docs", 401),
                ("/openapi.json", 401),
                ("/v1/models", 401),
            ):
                assert httpx.get(server.url + path).status_code == status, path
            authed = httpx.get(server.url + "/metrics", headers={"Authorization": "Bearer k3y"})
            assert authed.status_code == 200
        finally:
            server.stop()
