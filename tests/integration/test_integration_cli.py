"""`ninfer generate` end to end on the tiny dense artifact (in-process through `ninfer.cli.main.main`).

`--json` prints {"text", "token_ids", "finish_reason", "usage"} whose tokens are the public Engine's
greedy tokens for the same prompt; chat mode (the default) and `--no-think` render different prompts;
product errors exit 1 with one line on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from integration_helpers import fixture_tokenizer_ids, hf_greedy

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.cli.main import main
from ninfer.targets.open import load_frontend

torch.set_num_threads(1)
NAME = "qwen3_6_tiny"
PROMPT = "Write one sentence about paged attention."
NEW_TOKENS = 8


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()  # drop anything captured before
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_generate_raw_json_equals_engine_greedy(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, err = run_cli(
        capsys, "generate", str(tiny_artifact), PROMPT, "--raw", "--temperature", "0",
        "--max-tokens", str(NEW_TOKENS), "--json", "--device", "cpu",
    )
    assert rc == 0, err
    result = json.loads(out)
    assert {"text", "token_ids", "finish_reason", "usage"} <= result.keys()

    prompt_ids = fixture_tokenizer_ids(PROMPT)
    config = EngineConfig(max_concurrency=1, device="cpu", warmup=False)
    with Engine(tiny_artifact, config) as engine:
        expected = engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0))
        decoded = engine.frontend.decode(expected.token_ids, skip_special_tokens=True)
    assert result["token_ids"] == list(expected.token_ids)
    assert result["finish_reason"] == expected.finish_reason
    assert result["text"] == expected.text == decoded
    n = len(result["token_ids"])
    # and the Engine's greedy tokens are transformers' (up to an end-of-sequence stop, if any)
    assert tuple(result["token_ids"]) == hf_greedy(NAME, tuple(prompt_ids), NEW_TOKENS)[:n]
    assert result["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": n,
        "total_tokens": len(prompt_ids) + n,
        "cached_tokens": 0,  # one cold prompt: nothing reused
    }


def test_chat_default_and_no_think_render_different_prompts(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    common = ("generate", str(tiny_artifact), PROMPT, "--max-tokens", "1", "--json", "--device", "cpu")
    rc, think_out, err = run_cli(capsys, *common)
    assert rc == 0, err
    rc, no_think_out, err = run_cli(capsys, *common, "--no-think")
    assert rc == 0, err
    think = json.loads(think_out)["usage"]["prompt_tokens"]
    no_think = json.loads(no_think_out)["usage"]["prompt_tokens"]
    assert think != no_think
    frontend = load_frontend(str(tiny_artifact))
    messages = [{"role": "user", "content": PROMPT}]
    assert think == len(frontend.prepare_chat(messages, enable_thinking=True).token_ids)
    assert no_think == len(frontend.prepare_chat(messages, enable_thinking=False).token_ids)
    assert think > len(fixture_tokenizer_ids(PROMPT))  # the template wrapped the raw text


@pytest.mark.parametrize(
    ("extra", "prompt", "needle"),
    [
        (("--max-context", "8"), PROMPT * 4, "max_context"),  # prompt alone beyond the context
        (("--max-context", "64"), PROMPT, "lower max_tokens"),  # prompt + default 256 tokens beyond it
    ],
    ids=["prompt-beyond-context", "max-tokens-beyond-context"],
)
def test_generate_context_errors_exit_1_with_one_line(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], prompt: str, needle: str
) -> None:
    rc, out, err = run_cli(capsys, "generate", str(tiny_artifact), prompt, "--raw", "--device", "cpu", *extra)
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ninfer: error:") and needle in lines[0], err


def test_generate_missing_artifact_exits_1_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere.ninfer"
    rc, out, err = run_cli(capsys, "generate", str(missing), PROMPT, "--device", "cpu")
    assert rc == 1 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("ninfer: error:") and "nowhere.ninfer" in lines[0], err
