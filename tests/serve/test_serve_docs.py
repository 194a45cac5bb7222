"""The examples in docs/cli-and-http.md run verbatim against the default server (`ninfer serve`: the bundled
demo model, served as `qwen3_6_demo`, here on a free port): every `curl` line through bash with the real
curl (a `# causal_scoring server` block against a demo scoring server), every Python block with the
`openai` client, every JSON block parses, and `ninfer serve` refuses a bad option with exit status 1.
Examples marked as needing a vision tower get the documented 400 from the demo model, and run against a
vision package's server (scripted Program behind the tiny vision package's real Frontend)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serve_helpers import ScriptProgram, scripted_engine, wait_until

from ninfer import Engine
from ninfer.cli.common import bundled_artifact
from ninfer.cli.main import build_parser
from ninfer.cli.main import main as cli_main
from ninfer.cli.serve import engine_config, serve_config
from ninfer.serve import BackgroundServer, ImageInput, ServeConfig, create_app
from ninfer.targets.open import artifact_package, load_frontend

DOC = Path(__file__).parents[2] / "docs" / "cli-and-http.md"
DOC_URL = "http://127.0.0.1:8000"
DOC_MODEL = "qwen3_6_demo"  # the default server's model name
VISION_MODEL = "qwen3_6_27b"  # the vision examples name a real vision package
SCORING_MARK = "# causal_scoring server"
VISION_MARK = "# a model with a vision tower"
BLOCK = re.compile(r"```(\w*)\n(.*?)```", re.S)

pytestmark = pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")


def blocks(language: str) -> list[str]:
    return [body for lang, body in BLOCK.findall(DOC.read_text()) if lang == language]


@contextlib.contextmanager
def doc_server(engine: Engine, config: ServeConfig) -> Iterator[BackgroundServer]:
    server = BackgroundServer(create_app(engine, config))
    server.start()
    try:
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, 120)
        yield server
    finally:
        server.stop()


def default_server(*flags: str) -> tuple[Engine, ServeConfig]:
    """The Engine and gateway settings `ninfer serve [FLAGS]` runs with (the bundled demo model)."""
    args = build_parser(only="serve").parse_args(["serve", *flags])
    package = artifact_package(bundled_artifact())[0]
    config = serve_config(args, package.name, vision=package.has_vision)
    return Engine(bundled_artifact(), engine_config(args)), config


@pytest.fixture(scope="module")
def servers(tiny_artifact: Path) -> Iterator[dict[str, BackgroundServer]]:
    tiny = load_frontend(str(tiny_artifact))
    vision = scripted_engine(ScriptProgram(max_context=1024, page_size=16, kv_pages=256), tiny)
    seeing = ServeConfig(model_name=VISION_MODEL, images=ImageInput(vision=True))
    with (
        doc_server(*default_server()) as gen,
        doc_server(*default_server("--purpose", "causal_scoring")) as score,
        doc_server(vision, seeing) as vision_server,
    ):
        assert gen.url and httpx.get(gen.url + "/v1/models").json()["data"][0]["id"] == DOC_MODEL
        yield {"generation": gen, "causal_scoring": score, "vision": vision_server}


def curl_lines() -> list[tuple[str, str]]:
    """(purpose, command line) of every curl line in the docs."""
    out = []
    for body in blocks("bash"):
        purpose = (
            "causal_scoring" if SCORING_MARK in body else "vision" if VISION_MARK in body else "generation"
        )
        out += [(purpose, line) for line in body.splitlines() if line.startswith("curl ")]
    return out


def run_line(line: str, server: BackgroundServer) -> str:
    """The line, verbatim but for the port, through bash (pipefail: a grep that matches nothing fails)."""
    command = line.replace(DOC_URL, server.url)
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, (command, done.returncode, done.stderr)
    assert done.stdout.strip(), command
    return done.stdout


def check_output(line: str, out: str) -> None:
    """A 200 answer: JSON without an error, a stream ending in [DONE], headers of a 200, a status code."""
    if " | grep" in line:
        return  # the grep matched (pipefail)
    if "-w '%{http_code}" in line:
        assert out.strip() == "200", out
    elif " -i " in line:
        head = out.split("\r\n\r\n", 1)[0].lower()
        assert head.startswith("http/1.1 200"), head
        sent = re.search(r"-H 'X-Request-Id: ([^']+)'", line)
        if sent:
            assert f"x-request-id: {sent.group(1).lower()}" in head
    elif " -sN " in line:
        assert out.rstrip().endswith("data: [DONE]") and '"error"' not in out, out[-500:]
    else:
        assert "error" not in json.loads(out), out


def test_docs_have_examples() -> None:
    paths = {re.search(r"127\.0\.0\.1:8000(/[\w/]*)", line).group(1) for _, line in curl_lines()}  # type: ignore[union-attr]
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/ready",
        "/metrics",
        "/version",
        "/reset_prefix_cache",
    } <= paths
    assert any(purpose == "causal_scoring" for purpose, _ in curl_lines())
    assert blocks("python")


@pytest.mark.parametrize(("purpose", "line"), curl_lines())
def test_curl_examples_run(servers: dict[str, BackgroundServer], purpose: str, line: str) -> None:
    check_output(line, run_line(line, servers[purpose]))
    if purpose == "vision":  # the default server refuses it as documented
        error = json.loads(run_line(line, servers["generation"]))["error"]
        assert error["code"] == "unsupported_content" and "has no vision tower" in error["message"]


def _exec(code: str, server: BackgroundServer, monkeypatch: pytest.MonkeyPatch) -> str:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    try:
        exec(compile(code.replace(DOC_URL, server.url), str(DOC), "exec"), {})  # noqa: S102
    finally:
        monkeypatch.undo()
    return out.getvalue()


def test_python_examples_run(servers: dict[str, BackgroundServer], monkeypatch: pytest.MonkeyPatch) -> None:
    for code in blocks("python"):
        if VISION_MARK in code:
            assert _exec(code, servers["vision"], monkeypatch)
            with pytest.raises(openai.BadRequestError, match="has no vision tower"):
                _exec(code.replace(VISION_MODEL, DOC_MODEL), servers["generation"], monkeypatch)
            continue
        assert _exec(code, servers["generation"], monkeypatch)


def test_json_examples_parse() -> None:
    for body in blocks("json"):
        json.loads(body)


def test_serve_refuses_bad_options(tiny_artifact: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["serve", str(tiny_artifact), "--max-concurrency", "9"]) == 1
    assert "max_concurrency must be 1..8" in capsys.readouterr().err
    assert cli_main(["serve", str(tiny_artifact.parent / "missing.ninfer")]) == 1
    assert capsys.readouterr().err.startswith("ninfer: error:")
