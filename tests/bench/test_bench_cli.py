"""`ninfer bench` end to end on CPU, in process through `ninfer.cli.main.main`.

The bundled demo model with tiny settings gives a JSON report whose figures are positive, below their
floors' speed, one row per asked B, and whose floors are the roofline of the demo package at the run's
dtype and the measured bandwidth; `--synthetic qwen3_6_tiny` builds random weights through the binder,
the real Program and the real Qwen3.6 Frontend and labels the output. Bad arguments fail fast.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from datetime import datetime
from typing import Any

import pytest
import torch

from ninfer.bench.report import SYNTHETIC_NOTE
from ninfer.bench.roofline import decode_step_bytes, prefill_flops
from ninfer.cli.main import main
from ninfer.targets.registry import get_package
from ninfer.types import default_prefill_chunk

torch.set_num_threads(1)
TINY_SETTINGS = ("--context", "64", "--decode-steps", "8", "--prefill-tokens", "128", "--device", "cpu")


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def demo_report() -> tuple[dict[str, Any], str]:
    """One run shared by the tests below (a module fixture cannot take capsys: redirect by hand)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["bench", "--batch", "1,2", *TINY_SETTINGS, "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue()), err.getvalue()


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=2e-3, abs_tol=2e-3)


def test_demo_bench_uses_the_bundled_model_and_reports_every_field(demo_report: tuple[dict, str]) -> None:
    report, err = demo_report
    assert "no artifact given, using the bundled demo model qwen3_6_demo" in err
    assert report["package"] == "qwen3_6_demo" and report["synthetic"] is False and "note" not in report
    assert report["artifact"].endswith("qwen3_6_demo.ninfer")
    assert report["device"].startswith("cpu") and report["dtype"] == "float32"
    assert report["commit"] is None or re.fullmatch(r"[0-9a-f]{12}(-dirty)?", report["commit"])
    datetime.fromisoformat(report["date"])
    assert report["bandwidth_GBps"] > 0 and report["matmul_TFLOPs"] > 0
    phases = report["startup_s"]
    assert list(phases) == ["load_and_program", "worker_and_warmup", "total"]
    assert all(v > 0 for v in phases.values())
    assert close(phases["total"], phases["load_and_program"] + phases["worker_and_warmup"])


def test_demo_decode_rows_are_sane_and_beside_the_roofline(demo_report: tuple[dict, str]) -> None:
    report, _ = demo_report
    variant = get_package("qwen3_6_demo").variant
    bandwidth = report["bandwidth_GBps"] * 1e9
    assert [row["batch"] for row in report["decode"]] == [1, 2]
    for row in report["decode"]:
        b = row["batch"]
        assert row["context"] == 64 and row["steps"] == 8
        assert 0 < row["ms_step_min"] <= row["ms_step"] <= row["ms_step_max"]
        assert close(row["tok_s"], b * 1e3 / row["ms_step"])
        assert row["bytes_step"] == decode_step_bytes(variant, b, 64, torch.float32).total
        assert math.isclose(row["floor_ms"], row["bytes_step"] / bandwidth * 1e3, rel_tol=1e-3)
        assert 0 < row["floor_ms"] < row["ms_step"]
        assert close(row["pct_floor"], 100 * row["floor_ms"] / row["ms_step"]) and row["pct_floor"] < 100


def test_demo_prefill_ttft_tpot_are_sane(demo_report: tuple[dict, str]) -> None:
    report, _ = demo_report
    variant = get_package("qwen3_6_demo").variant
    prefill = report["prefill"]
    assert (prefill["tokens"], prefill["repeats"]) == (128, 3)
    assert prefill["chunk"] == default_prefill_chunk("reference")  # the CPU runs the reference table
    assert prefill["flops"] == prefill_flops(variant, 128).total
    assert 0 < prefill["floor_ms"] < prefill["ms"]
    assert math.isclose(prefill["tok_s"], 128e3 / prefill["ms"], rel_tol=1e-3)
    assert math.isclose(report["ttft_floor_ms"], prefill["floor_ms"], rel_tol=1e-3)
    assert 0 < report["ttft_floor_ms"] < report["ttft_ms"]
    tpot_bytes = decode_step_bytes(variant, 1, 128, torch.float32).total
    tpot_floor = tpot_bytes / (report["bandwidth_GBps"] * 1e9) * 1e3
    assert math.isclose(report["tpot_floor_ms"], tpot_floor, rel_tol=1e-3)
    assert 0 < report["tpot_floor_ms"] < report["tpot_ms"]
    assert report["settings"]["max_context"] >= 128 + 9


def test_synthetic_tiny_runs_on_cpu_and_is_labelled(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "bench", "--synthetic", "qwen3_6_tiny", "--batch", "3", *TINY_SETTINGS)
    assert rc == 0, err
    assert "bundled demo model" not in err
    lines = out.splitlines()
    assert lines[0].startswith("ninfer bench: qwen3_6_tiny on cpu")
    assert f"*** {SYNTHETIC_NOTE} ***" in lines
    start = next(i for i, line in enumerate(lines) if line.startswith("start-up:"))
    assert all(f"{p} " in lines[start] for p in ("materialize", "frontend", "program", "worker and warmup"))
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["B", "ms/step"])
    row = lines[header + 1].split()
    assert row[0] == "3" and float(row[1]) > float(row[3]) > 0  # measured ms above the floor ms
    assert lines[header + 2] == ""  # exactly the one asked B
    assert any(line.startswith("prefill 128 tokens") for line in lines)
    assert any(line.startswith("TTFT ") and "TPOT " in line for line in lines)


def test_argument_errors_fail_fast(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run_cli(capsys, "bench", "model.ninfer", "--synthetic", "qwen3_6_tiny")
    assert rc == 1 and "not both" in err
    rc, _, err = run_cli(capsys, "bench", "--synthetic", "qwen9")
    assert rc == 1 and "unknown package 'qwen9'" in err
    too_long = ("--context", "8000", "--decode-steps", "9000")  # 8,000 + the decode budget > 16,384
    rc, _, err = run_cli(capsys, "bench", "--synthetic", "qwen3_6_tiny", *too_long)
    assert rc == 1 and "the model holds 16384" in err
    for bad in ("0", "9", "1,x"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--batch", bad])
        assert exit_info.value.code == 2


def test_default_prefill_length_is_capped_to_the_model_positions(capsys: pytest.CaptureFixture[str]) -> None:
    from argparse import Namespace

    from ninfer.cli.bench import DEFAULT_PREFILL_TOKENS, _prefill_tokens

    assert _prefill_tokens(Namespace(prefill_tokens=None, decode_steps=64), 262144) == DEFAULT_PREFILL_TOKENS
    assert capsys.readouterr().err == ""
    assert _prefill_tokens(Namespace(prefill_tokens=None, decode_steps=64), 8192) == 8192 - 65
    assert "prefill uses 8127" in capsys.readouterr().err
    assert _prefill_tokens(Namespace(prefill_tokens=9000, decode_steps=64), 8192) == 9000  # refused later


def test_demo_bench_names_its_kernels_and_weight_load(demo_report: tuple[dict, str]) -> None:
    report, _ = demo_report
    assert report["settings"]["kernels"] == "reference"  # auto on a CPU
    load = report["load"]  # numbers, as the rest of the JSON
    assert load["device"] == "cpu" and load["bytes"] > 1e6 and load["seconds"] > 0 and load["GBps"] > 0
    assert load["tensors"] > 0 and load["zero_copy"] is False


def test_standard_suite_runs_cold_unless_the_cache_is_asked_for(
    demo_report: tuple[dict, str], capsys: pytest.CaptureFixture[str]
) -> None:
    report, _ = demo_report
    assert report["settings"]["prefix_cache"] is False
    rc, out, err = run_cli(
        capsys, "bench", "--batch", "1", "--context", "32", "--decode-steps", "4", "--prefill-tokens", "64",
        "--device", "cpu", "--prefill-repeats", "1", "--prefix-cache", "on", "--cache-memory-gb", "0.01",
        "--json",
    )  # fmt: skip
    assert rc == 0, err
    on = json.loads(out)
    assert on["settings"]["prefix_cache"] is True and [r["batch"] for r in on["decode"]] == [1]


def test_a_speculative_sweep_runs_each_backend_over_one_set_of_weights(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out, err = run_cli(
        capsys, "bench", "--synthetic", "qwen3_6_tiny", "--batch", "1,2", *TINY_SETTINGS,
        "--speculative", "off,mtp:2,known:2@2.5", "--draft-vocab", "64", "--json",
    )  # fmt: skip
    assert rc == 0, err
    reports = [json.loads(line) for line in out.splitlines()]  # one report per line, as each finishes
    assert [r["settings"]["speculative"] for r in reports] == [None, "mtp:2", "known:2@2.5"]
    assert [r["settings"]["draft_vocab"] for r in reports] == [None, 64, None]  # mtp's head only
    assert [r["decode"][0]["tokens_per_round"] for r in reports] == [1.0, 1.0, 2.5]
    assert [[d["batch"] for d in r["decode"]] for r in reports] == [[1, 2]] * 3
    assert err.count("probing cpu memory bandwidth") == 1  # the probes and the weights once
    assert err.count("restarting the Engine") == 2
    assert "materialize" in reports[0]["startup_s"]
    assert all("materialize" not in r["startup_s"] for r in reports[1:])
    rc, out, err = run_cli(
        capsys,
        "bench",
        "--synthetic",
        "qwen3_6_tiny",
        "--batch",
        "1",
        *TINY_SETTINGS,
        "--speculative",
        "off,mtp:1",
    )
    assert rc == 0, err
    assert "== speculative: off" in out and "== speculative: mtp:1" in out


def test_speculative_sweep_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("mtp:0", "off,mtp:x", "mtp:1,,"):
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--speculative", bad])
        assert exit_info.value.code == 2
    rc, _, err = run_cli(capsys, "bench", "--concurrency", "1", "--speculative", "off,mtp:1")
    assert rc == 1 and "takes one decode backend" in err
