"""`ninfer bench --multi-turn` on CPU with the bundled demo model: a row per turn whose reused prefix
covers at least the previous prompt up to its reply start (a bound computed from the prompts, not read
back from the cache), cold-new rows of exactly the prefilled tokens with nothing reused, decode with the
cache on and off, captures timed, checkpoint bytes and budget; plus the pieces (message lengths, the
lower bound, the transition clock) and the flag checks."""

from __future__ import annotations

import contextlib
import io
import json
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ninfer.bench.multiturn import (
    RATIO_ALLOWANCE,
    SLACK_MS,
    TEMPLATE_KWARGS,
    TransitionClock,
    WordSource,
    reuse_lower_bound,
)
from ninfer.bench.runner import first_special_id
from ninfer.cli.common import bundled_artifact
from ninfer.cli.main import main
from ninfer.targets.open import load_frontend
from ninfer.targets.qwen3_6_demo import PACKAGE as DEMO

torch.set_num_threads(1)
TURNS, TURN_TOKENS, REPLY = 3, 48, 4
ARGS = (
    "bench", "--multi-turn", str(TURNS), "--turn-tokens", str(TURN_TOKENS), "--reply-tokens", str(REPLY),
    "--context", "32", "--decode-steps", "4", "--device", "cpu",
)  # fmt: skip


@pytest.fixture(scope="module")
def frontend() -> Any:
    return load_frontend(bundled_artifact())


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*ARGS, "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def generation_prompt_tokens(frontend: Any) -> int:
    """Tokens of the generation prompt after its reply-start boundary (the part a turn's next prompt
    renders differently)."""
    prompt = frontend.prepare_chat([{"role": "user", "content": "x"}], **TEMPLATE_KWARGS)
    return len(prompt.token_ids) - prompt.boundaries[-1]


def test_a_row_per_turn_reusing_the_previous_prompt(report: dict[str, Any], frontend: Any) -> None:
    assert report["mode"] == "multi_turn" and report["package"] == "qwen3_6_demo"
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[0]["reused_tokens"] == 0 and turns[0]["expected_reused_min"] == 0
    tail = generation_prompt_tokens(frontend)
    assert 1 <= tail <= 8
    for before, turn in zip(turns, turns[1:]):
        # the previous prompt up to its reply start is this prompt's prefix, and its prefill captured it
        bound = before["prompt_tokens"] - tail
        assert turn["expected_reused_min"] == bound
        assert turn["reused_tokens"] >= bound > 0
        assert turn["prompt_tokens"] > before["prompt_tokens"] + TURN_TOKENS
    for turn in turns:
        assert turn["new_tokens"] == turn["prompt_tokens"] - turn["reused_tokens"]
        assert turn["ttft_ms"] > 0 and turn["prefill_ms"] > 0 and turn["submit_ms"] > 0
        assert turn["ttft_ms"] >= turn["submit_ms"]
    assert turns[0]["prompt_tokens"] > TURN_TOKENS  # the system turn and the markers come first


def test_cold_new_rows_prefill_the_same_tokens_from_nothing(report: dict[str, Any]) -> None:
    for turn in report["turns"]:
        cold = turn["cold_new"]
        assert cold["reused_tokens"] == 0
        assert cold["tokens"] == turn["new_tokens"]
        assert cold["ttft_ms"] > 0 and cold["prefill_ms"] > 0
        assert math.isclose(turn["ratio"], turn["ttft_ms"] / cold["ttft_ms"], rel_tol=1e-3)
        assert math.isclose(turn["allowance_ms"], RATIO_ALLOWANCE * cold["ttft_ms"] + SLACK_MS, rel_tol=1e-3)
        assert turn["within_allowance"] == (turn["ttft_ms"] <= turn["allowance_ms"])
    target = report["target"]
    assert target["turns_checked"] == TURNS - 1
    assert target["turns_within"] == sum(t["within_allowance"] for t in report["turns"][1:])


def test_decode_on_and_off_captures_and_checkpoint_budget(report: dict[str, Any]) -> None:
    on, off = report["decode"]["cache_on"], report["decode"]["cache_off"]
    for row in (on, off):
        assert row["batch"] == 1 and row["context"] == 32 and row["steps"] == 4
        assert 0 < row["ms_step_min"] <= row["ms_step"] <= row["ms_step_max"]
    assert math.isclose(report["decode"]["on_over_off"], on["ms_step"] / off["ms_step"], rel_tol=1e-3)
    capture = report["capture"]
    assert capture["captures"] >= TURNS  # every turn's reply start
    assert capture["timing"] == "host (cpu)" and capture["device_ms"]["median"] > 0
    assert capture["retains"] == 0  # ignore_eos: every turn ends by length
    cache = report["cache"]
    assert cache["hits"] == TURNS - 1
    assert cache["hit_tokens"] == sum(t["reused_tokens"] for t in report["turns"])
    assert cache["captures"] == capture["captures"]
    # the demo's CPU budget has room for 2 checkpoint slots: the oldest capture makes way for the newest
    assert cache["checkpoints"] == cache["captures"] + cache["retains"] - cache["evictions"] >= 1
    assert cache["checkpoints"] <= cache["checkpoint_slots"]
    assert cache["bytes_per_checkpoint"] == cache["checkpoint_bytes"] // cache["checkpoints"]
    assert cache["budget_bytes"] > 0 and cache["checkpoint_slots"] > 0
    assert 0 < cache["fit"] <= cache["checkpoint_slots"]
    assert cache["fit"] == min(
        cache["checkpoint_slots"], cache["budget_bytes"] // cache["bytes_per_checkpoint"]
    )
    assert cache["conversation_bytes"] > cache["bytes_per_checkpoint"]
    s = report["settings"]
    assert (s["turns"], s["turn_tokens"], s["reply_tokens"]) == (TURNS, TURN_TOKENS, REPLY)
    assert s["max_context"] >= report["turns"][-1]["prompt_tokens"] + REPLY


def test_table_shows_the_turns_and_the_target(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main([*ARGS[:2], "2", *ARGS[3:]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ninfer bench --multi-turn: qwen3_6_demo on cpu")
    header = next(i for i, line in enumerate(lines) if line.split()[:3] == ["turn", "prompt", "reused"])
    assert [lines[header + k].split()[0] for k in (1, 2)] == ["1", "2"]
    assert any(line.startswith("target turn-k TTFT <= 1.15 x cold-new TTFT + 5 ms: ") for line in lines)
    assert any(line.startswith("decode B=1 at context 32") and "cache on" in line for line in lines)
    assert any(line.startswith("turn-end retains: 0") for line in lines)


def test_messages_have_the_exact_token_count(frontend: Any) -> None:
    words = WordSource(frontend.encode, frontend.decode, first_special_id(DEMO.variant.special), seed=1)
    for n in (1, 7, 48, 300):
        assert len(frontend.encode(words.text(n))) == n
    assert words.text(20) != words.text(20)


def test_reuse_lower_bound() -> None:
    previous = [1, 2, 3, 4, 5, 6]
    current = [1, 2, 3, 4, 9, 9, 9]
    assert reuse_lower_bound(previous, (2, 4), current) == 4
    assert reuse_lower_bound(previous, (2, 5), current) == 2  # 5 is past the shared prefix
    assert reuse_lower_bound(previous, (), current) == 0
    assert reuse_lower_bound([1, 2], (2,), [1, 2]) == 0  # the whole prompt: one token must be prefilled


def test_transition_clock_times_published_calls_and_comes_off() -> None:
    class Program:
        def capture(self, handle: int, evictable: tuple = ()) -> SimpleNamespace:
            return SimpleNamespace(published=(handle,) if handle else ())

        def retain(self, handle: int, evictable: tuple = ()) -> SimpleNamespace:
            return SimpleNamespace(published=(handle,))

    program = Program()
    clock = TransitionClock(program, torch.device("cpu"))
    assert program.capture(1).published == (1,)
    program.capture(0)  # nothing published: not a capture to time
    program.retain(2)
    assert len(clock.device_ms("capture")) == 1 and len(clock.host_ms("retain")) == 1
    assert clock.device_ms("capture") == clock.host_ms("capture")
    clock.remove()
    assert "capture" not in vars(program) and program.capture(3).published == (3,)
    assert len(clock.calls["capture"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--multi-turn", "2", "--image", "64x64"), "give one of --multi-turn, --image and --interference"),
        (("--turn-tokens", "64",), "--turn-tokens needs --multi-turn"),
        (("--reply-tokens", "4",), "--reply-tokens needs --multi-turn"),
        (("--image-repeats", "2",), "--image-repeats needs --image"),
        (("--multi-turn", "2", "--prefix-cache", "off"), "always runs with the context cache on"),
        (("--cache-memory-gb", "1",), "--cache-memory-gb needs the context cache"),
        (("--prefix-cache", "off", "--cache-memory-gb", "1"), "--cache-memory-gb needs the context cache"),
        (("--host-cache-gb", "1",), "--host-cache-gb needs the context cache"),
        (("--multi-turn", "2", "--batch", "2"), "--batch is for the standard suite"),
        (("--image", "64x64", "--speculative", "mtp:2"), "--speculative is for the standard suite"),
        (("--multi-turn", "2", "--reply-tokens", "1"), "--reply-tokens must be >= 2"),
        (("--image", "64x64", "--device", "cpu"), "has no vision tower"),
        (("--synthetic", "qwen3_6_tiny", "--multi-turn", "10", "--turn-tokens", "2048"), "model holds 16384"),
    ],
)  # fmt: skip
def test_mode_flag_errors(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    capsys.readouterr()
    assert main(["bench", *argv]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ("--multi-turn", "0"),
        ("--image", "448"),
        ("--image", "0x5"),
        ("--image", "1x1000"),  # aspect ratio over 200
        ("--image", "9000x10"),
        ("--cache-memory-gb", "-1"),
        ("--host-cache-gb", "-1"),
        ("--prefix-cache", "maybe"),
    ],
)
def test_bad_mode_values_exit_2(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
