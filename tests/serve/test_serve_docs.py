"""The examples in docs/cli-and-http.md run: every `curl` line against a server (scripted Programs behind
the real Qwen3.6 Frontend, served under the docs' model name), every Python block with the `openai`
client, every JSON block parses, and `ninfer serve` refuses a bad option with exit status 1."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serve_helpers import ScriptedScoringProgram, ScriptProgram, scripted_engine, wait_until

from ninfer import Engine, EngineConfig
from ninfer.cli.main import main as cli_main
from ninfer.serve import BackgroundServer, ServeConfig, create_app
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6.frontend import Frontend

DOC = Path(__file__).parents[2] / "docs" / "cli-and-http.md"
DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = "qwen3_6_27b"
SCORING_MARK = "# causal_scoring server"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)


@functools.cache
def frontend_of(path: str) -> Frontend:
    return load_frontend(path)


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(DOC.read_text()) if lang == language]


@contextlib.contextmanager
def doc_server(engine: Engine) -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(engine, ServeConfig(model_name=DOC_MODEL)))  # the Engine's Frontend
    server.start()
    try:
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, 30)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path) -> Iterator[dict[str, BackgroundServer]]:
    frontend = frontend_of(str(tiny_artifact))
    generation = scripted_engine(ScriptProgram(max_context=1024, page_size=16, kv_pages=256), frontend)
    scoring = Engine.from_parts(
        ScriptedScoringProgram(max_context=64),
        frontend,
        EngineConfig(purpose="causal_scoring", score_window=64, score_stride=32, warmup=False),
    )
    with doc_server(generation) as gen, doc_server(scoring) as score:
        yield {"generation": gen, "causal_scoring": score}


def curl_calls() -> list[tuple[str, str, str, dict | None]]:
    """(server purpose, method, path, JSON body) of every curl line in the docs."""
    calls = []
    for body in blocks("bash"):
        purpose = "causal_scoring" if SCORING_MARK in body else "generation"
        for line in body.splitlines():
            if not line.startswith("curl "):
                continue
            words = shlex.split(line.split(" | ")[0])
            url = next(w for w in words if w.startswith(DOC_URL))
            data = words[words.index("-d") + 1] if "-d" in words else None
            calls.append(
                (purpose, "POST" if data else "GET", url[len(DOC_URL) :], json.loads(data) if data else None)
            )
    return calls


def test_docs_have_examples() -> None:
    calls = curl_calls()
    paths = {path for _, _, path, _ in calls}
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/ready",
        "/metrics",
    } <= paths
    assert any(purpose == "causal_scoring" for purpose, *_ in calls)
    assert blocks("python")


@pytest.mark.parametrize(("purpose", "method", "path", "body"), curl_calls())
def test_curl_examples_run(
    servers: dict[str, BackgroundServer], purpose: str, method: str, path: str, body: dict | None
) -> None:
    response = httpx.request(method, servers[purpose].url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text


def test_python_examples_run(servers: dict[str, BackgroundServer], monkeypatch: pytest.MonkeyPatch) -> None:
    for code in blocks("python"):
        out = io.StringIO()
        monkeypatch.setattr(sys, "stdout", out)
        exec(compile(code.replace(DOC_URL, servers["generation"].url), str(DOC), "exec"), {})  # noqa: S102
        monkeypatch.undo()
        assert out.getvalue()


def test_json_examples_parse() -> None:
    for body in blocks("json"):
        json.loads(body)


def test_serve_refuses_bad_options(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", str(tiny_artifact), "--max-concurrency", "9"]) == 1
    assert "max_concurrency must be 1..8" in capsys.readouterr().err
    assert cli_main(["serve", str(tiny_artifact.parent / "missing.ninfer")]) == 1
    assert capsys.readouterr().err.startswith("ninfer: error:")
