"""Scoring windows from the command line: `ninfer serve --purpose causal_scoring` takes --score-window /
--score-stride, and --max-context sets the window unless --score-window is given (a scoring Engine's
context is its window); `ninfer score` resolves --window/--stride the same way; /v1/models reports the
window."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from serve_helpers import MODEL, ScriptProgram, running_server, scripted_engine

from ninfer import Engine, EngineConfig
from ninfer.cli.main import build_parser
from ninfer.cli.main import main as cli_main
from ninfer.cli.serve import engine_config
from ninfer.targets.open import load_frontend

BIGGER_THAN_DEFAULT_WINDOW = EngineConfig().score_window + 512


def _serve_config(*flags: str) -> EngineConfig:
    args = build_parser(only="serve").parse_args(["serve", "model.ninfer", *flags])
    return engine_config(args)


def test_serve_flags_resolve_the_window(capsys: pytest.CaptureFixture[str]) -> None:
    default = EngineConfig()
    plain = _serve_config("--purpose", "causal_scoring")
    assert (plain.score_window, plain.score_stride, plain.max_context) == (
        default.score_window, default.score_stride, None
    )
    by_context = _serve_config("--purpose", "causal_scoring", "--max-context", "4096")
    assert (by_context.score_window, by_context.score_stride, by_context.max_context) == (4096, 2048, None)
    assert capsys.readouterr().err == ""
    both = _serve_config("--purpose", "causal_scoring", "--max-context", "4096", "--score-window", "64")
    assert (both.score_window, both.score_stride) == (64, 32)
    assert "--max-context 4096 is ignored" in capsys.readouterr().err
    explicit = _serve_config("--purpose", "causal_scoring", "--score-window", "64", "--score-stride", "48")
    assert (explicit.score_window, explicit.score_stride) == (64, 48)
    generation = _serve_config("--max-context", "4096")
    assert generation.max_context == 4096 and generation.purpose == "generation"
    with pytest.raises(ValueError, match="score_stride must be"):
        _serve_config("--purpose", "causal_scoring", "--score-window", "64", "--score-stride", "64")


def test_serve_refuses_window_flags_for_generation(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["serve", str(tiny_artifact), "--score-window", "64"]) == 1
    assert "apply to --purpose causal_scoring only" in capsys.readouterr().err


def test_scoring_server_with_a_long_max_context_reports_its_window(tiny_artifact: Path) -> None:
    """--max-context beyond the default window used to fail ("exceeds what the Program holds")."""
    frontend = load_frontend(str(tiny_artifact))
    config = _serve_config(
        "--purpose", "causal_scoring", "--max-context", str(BIGGER_THAN_DEFAULT_WINDOW), "--device", "cpu"
    )
    with running_server(Engine(tiny_artifact, config), frontend) as srv:
        card = httpx.get(srv.url + "/v1/models").json()["data"][0]
        one = httpx.get(srv.url + f"/v1/models/{MODEL}").json()
        ids = frontend.encode("The quick brown fox")
        scored = httpx.post(
            srv.url + "/v1/completions",
            json={"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0},
            timeout=60,
        )
    window, stride = BIGGER_THAN_DEFAULT_WINDOW, BIGGER_THAN_DEFAULT_WINDOW // 2
    assert (card["max_model_len"], card["score_window"], card["score_stride"]) == (window, window, stride)
    assert one == card
    assert scored.status_code == 200 and len(scored.json()["choices"][0]["logprobs"]["tokens"]) == len(ids)


def test_generation_model_card_has_no_scoring_fields(tiny_artifact: Path) -> None:
    frontend = load_frontend(str(tiny_artifact))
    engine = scripted_engine(ScriptProgram(max_context=64, page_size=16, kv_pages=16), frontend)
    with running_server(engine, frontend) as srv:
        card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == 64 and "score_window" not in card and "score_stride" not in card


def test_score_cli_max_context_is_the_window(
    tiny_artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog.", encoding="utf-8")
    base = ["score", str(tiny_artifact), str(text), "--json", "--device", "cpu", "--dtype", "float32"]
    assert cli_main([*base, "--max-context", str(BIGGER_THAN_DEFAULT_WINDOW)]) == 0, capsys.readouterr().err
    whole = json.loads(capsys.readouterr().out)
    # a window given too wins over --max-context (with a warning); its stride defaults to half of it
    assert cli_main([*base, "--max-context", "4096", "--window", "6"]) == 0
    out = capsys.readouterr()
    windowed = json.loads(out.out)
    assert "--max-context 4096 is ignored" in out.err
    assert windowed["token_ids"] == whole["token_ids"] and len(whole["token_ids"]) > 6
    head = 6  # tokens 1..5 lie in the first window either way: the same values
    assert windowed["logprobs"][1:head] == pytest.approx(whole["logprobs"][1:head], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(windowed["logprobs"][head:], whole["logprobs"][head:])) > 1e-4
