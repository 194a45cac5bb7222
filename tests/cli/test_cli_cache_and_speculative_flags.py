"""`--prefix-cache`, `--cache-memory-gb`, `--host-cache-gb`, `--capture-interval` and `--speculative` on
`serve`, `generate` and `chat`: bad values are one-line errors (exit 2), good ones reach EngineConfig, a
package without an MTP layer is refused with one line before any weight is read, `generate --json`
reports the drafts and the cached prompt tokens, and `chat` continues its own session every turn (the
bundled demo model)."""

from __future__ import annotations

import dataclasses
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_artifacts import write_tiny_artifact

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli import serve as serve_cmd
from ninfer.cli.common import interactive_engine_config
from ninfer.cli.main import build_parser, main
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

NO_MTP = "qwen3_6_tiny_nomtp"


def run(capsys: pytest.CaptureFixture[str], *argv: str, stdin: str = "") -> tuple[int, str, str]:
    """Exit status, stdout and stderr of one command (argparse's own exit for a bad flag included)."""
    capsys.readouterr()
    saved = sys.stdin
    sys.stdin = io.StringIO(stdin)
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = int(exc.code or 0)
    finally:
        sys.stdin = saved
    out, err = capsys.readouterr()
    return rc, out, err


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error" in line or "Traceback" in line]


COMMANDS = {
    "serve": ("serve", "--port", "1"),
    "generate": ("generate", "hi", "--device", "cpu"),
    "chat": ("chat", "--device", "cpu"),
}
BAD = [
    (("--prefix-cache", "maybe"), "argument --prefix-cache: expected on or off, got 'maybe'"),
    (("--prefix-cache", "true"), "argument --prefix-cache: expected on or off"),
    (("--cache-memory-gb", "-1"), "argument --cache-memory-gb: expected a number of GB >= 0, got '-1'"),
    (("--cache-memory-gb", "lots"), "argument --cache-memory-gb: expected a number of GB >= 0"),
    (("--cache-memory-gb", "nan"), "argument --cache-memory-gb: expected a number of GB >= 0"),
    (("--host-cache-gb", "-0.5"), "argument --host-cache-gb: expected a number of GB >= 0, got '-0.5'"),
    (("--host-cache-gb", "inf"), "argument --host-cache-gb: expected a number of GB >= 0"),
    (("--capture-interval", "0"), "argument --capture-interval: expected an integer >= 1, got 0"),
    (("--capture-interval", "1.5"), "argument --capture-interval: expected an integer, got '1.5'"),
    (("--speculative", "mtp:0"), "argument --speculative: speculative draft tokens K must be 1..8, got 0"),
    (("--speculative", "mtp:9"), "argument --speculative: speculative draft tokens K must be 1..8, got 9"),
    (("--speculative", "mtp"), "argument --speculative: expected mtp:K (K = 1..8"),
    (("--speculative", "mtp:two"), "argument --speculative: expected mtp:K (K = 1..8"),
    (("--speculative", "eagle:2"), "argument --speculative: expected mtp:K (K = 1..8"),
    (("--speculative", "known:2@1.5"), "known:K@TAU is a benchmark backend (ninfer bench)"),
]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize(("flags", "message"), BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_values_are_one_line_exit_2(
    command: str, flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = run(capsys, *COMMANDS[command], *flags)
    lines = error_lines(err)
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ninfer {command}: error: ") and message in lines[0], lines


def parse(command: str, *flags: str) -> Any:
    positional = {"generate": ("hi",), "chat": (), "serve": ()}[command]
    return build_parser(only=command).parse_args([command, *positional, *flags])


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_flags_reach_the_engine_config(command: str) -> None:
    def config(*flags: str) -> EngineConfig:
        args = parse(command, *flags)
        return serve_cmd.engine_config(args) if command == "serve" else interactive_engine_config(args)

    default, given = (
        config(),
        config(
            "--prefix-cache",
            "off",
            "--cache-memory-gb",
            "0.25",
            "--capture-interval",
            "512",
            "--speculative",
            "mtp:3",
            "--host-cache-gb",
            "8",
        ),
    )
    assert (default.host_cache_gb, given.host_cache_gb) == (0.0, 8.0)
    assert (default.prefix_cache, default.cache_memory_gb, default.capture_interval, default.speculative) == (
        True,
        None,
        8192,
        None,
    )
    assert (given.prefix_cache, given.cache_memory_gb, given.capture_interval, given.speculative) == (
        False,
        0.25,
        512,
        "mtp:3",
    )
    assert config("--prefix-cache", "on").prefix_cache is True


def test_scoring_server_refuses_the_generation_only_flags(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (("--speculative", "mtp:2"), ("--prefix-cache", "off", "--capture-interval", "64")):
        rc, _, err = run(capsys, "serve", "--purpose", "causal_scoring", *flags, "--port", "1")
        lines = error_lines(err)
        assert rc == 1 and len(lines) == 1 and "for --purpose generation only" in lines[0], err
        assert flags[0] in lines[0]


GENERATE = ("generate", "def fibonacci(n):", "--raw", "--temperature", "0", "--max-tokens", "12", "--json")


def test_generate_json_reports_the_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, *GENERATE, "--device", "cpu", "--speculative", "mtp:2")
    assert rc == 0, err
    fast = json.loads(out)
    rc, out, err = run(capsys, *GENERATE, "--device", "cpu")
    assert rc == 0, err
    plain = json.loads(out)
    assert fast["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 12
    assert "speculative" not in plain
    spec = fast["speculative"]
    assert set(spec) == {"method", "k", "drafted", "accepted"}
    assert (spec["method"], spec["k"]) == ("mtp", 2)
    assert spec["drafted"] > 0 and spec["drafted"] % 2 == 0 and 0 <= spec["accepted"] <= spec["drafted"]
    rounds = spec["drafted"] // 2
    assert rounds + spec["accepted"] <= 12 <= 1 + rounds + spec["accepted"]
    assert (
        fast["usage"]["cached_tokens"] == plain["usage"]["cached_tokens"] == 0
    )  # one request: nothing cached
    # the plain-text summary on stderr says it too
    rc, _, err = run(capsys, *GENERATE[:-1], "--device", "cpu", "--speculative", "mtp:2")
    assert rc == 0 and f"{spec['accepted']}/{spec['drafted']} drafts accepted" in err and "(0 cached)" in err


# ---- a package without an MTP layer ----------------------------------------------------------------


@pytest.fixture(scope="module")
def no_mtp_artifact(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The tiny dense package with its MTP layer removed, registered for this module only."""
    tiny = PACKAGES["qwen3_6_tiny"]
    package = dataclasses.replace(
        tiny,
        name=NO_MTP,
        variant=dataclasses.replace(tiny.variant, mtp_num_hidden_layers=0),
        description="tiny dense test package without MTP",
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(PACKAGES, NO_MTP, package)
        yield write_tiny_artifact(NO_MTP, tmp_path_factory.mktemp("nomtp") / f"{NO_MTP}.ninfer")


def test_the_engine_refuses_mtp_without_an_mtp_layer(no_mtp_artifact: Path) -> None:
    with pytest.raises(ValueError, match="this model has no MTP layer"):
        Engine(str(no_mtp_artifact), EngineConfig(device="cpu", warmup=False, speculative="mtp:2"))
    with Engine(str(no_mtp_artifact), EngineConfig(device="cpu", warmup=False)) as engine:  # the control
        assert engine.generate(GenerationRequest(prompt="hi", max_tokens=1)).usage.completion_tokens == 1


@pytest.mark.parametrize("command", ["serve", "generate", "chat"])
def test_commands_refuse_mtp_without_an_mtp_layer_in_one_line(
    command: str, no_mtp_artifact: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_engine(*args: object, **kwargs: object) -> None:
        raise AssertionError("refused from the header, before any weight is read (or a port opened)")

    monkeypatch.setattr("ninfer.Engine.__init__", no_engine)
    monkeypatch.setattr("ninfer.serve.serve_forever", no_engine)
    path = str(no_mtp_artifact)
    argv = {
        "serve": ("serve", path, "--port", "1"),
        "generate": ("generate", path, "hi", "--device", "cpu"),
        "chat": ("chat", path, "--device", "cpu"),
    }[command]
    rc, _, err = run(capsys, *argv, "--speculative", "mtp:2", stdin="hi\n")
    lines = error_lines(err)
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0] == (
        f"ninfer: error: --speculative mtp:2: package '{NO_MTP}' has no MTP layer (no multi-token prediction "
        "weights to draft with); drop --speculative"
    )


# ---- chat ------------------------------------------------------------------------------------------


def chat_requests(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: str, *flags: str
) -> tuple[list[GenerationRequest], str]:
    seen: list[GenerationRequest] = []
    real = Engine.submit

    def submit(self: Engine, request: GenerationRequest) -> Any:
        seen.append(request)
        return real(self, request)

    monkeypatch.setattr(Engine, "submit", submit)
    rc, _, err = run(
        capsys,
        "chat",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--verbose",
        "--device",
        "cpu",
        *flags,
        stdin=stdin,
    )
    assert rc == 0, err
    return seen, err


def cached_counts(err: str) -> list[int]:
    return [
        int(line.split(" prompt (")[1].split(" cached")[0])
        for line in err.splitlines()
        if " cached) + " in line
    ]


def test_chat_turns_continue_one_session_and_reuse_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen, err = chat_requests(monkeypatch, capsys, "def add(a, b):\nclass Stack:\nimport os\n/reset\nx = 1\n")
    sessions = [r.session_id for r in seen]
    assert len(sessions) == 4 and all(sessions)
    assert sessions[0] == sessions[1] == sessions[2] != sessions[3], "one session until /reset"
    cached = cached_counts(err)
    assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1], cached


def test_chat_with_the_cache_off_reuses_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, err = chat_requests(monkeypatch, capsys, "def add(a, b):\nclass Stack:\n", "--prefix-cache", "off")
    assert cached_counts(err) == [0, 0]


def test_chat_verbose_reports_the_drafts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, err = chat_requests(monkeypatch, capsys, "def add(a, b):\n", "--speculative", "mtp:2")
    assert "drafts accepted" in err
