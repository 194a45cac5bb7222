"""`ninfer bench --interference` on CPU (synthetic tiny package): the report's runs (pacing at each
given bound, then off), each with the long prompt's TTFT alone and among decoding streams and the
streams' gaps while it was prefilled; and the flag checks. CPU times are noise: only the report's
shape and its own consistency are checked, never a time."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from ninfer.cli.main import main

torch.set_num_threads(1)
ARGS = (
    "bench", "--synthetic", "qwen3_6_tiny", "--device", "cpu", "--interference", "600", "--streams", "2",
    "--context", "32", "--max-decode-gap-ms", "50,80", "--json",
)  # fmt: skip


def test_the_report_has_a_paced_run_per_bound_and_an_unpaced_run() -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(list(ARGS)) == 0, err.getvalue()
    report = json.loads(out.getvalue())
    assert report["mode"] == "interference" and report["settings"]["streams"] == 2
    on, on_80, off = report["rows"]
    assert (on["pacing"], on["max_decode_gap_ms"]) == ("on", 50.0)
    assert (on_80["pacing"], on_80["max_decode_gap_ms"]) == ("on", 80.0)
    assert (off["pacing"], off["max_decode_gap_ms"]) == ("off", 0.0)
    for row in (on, on_80, off):
        assert row["gaps"] >= 1 and row["ttft_ms"] > 0 and row["solo_ttft_ms"] > 0
        assert row["gap_median_ms"] <= row["gap_p99_ms"] <= row["gap_max_ms"]
        assert row["ttft_vs_solo"] == pytest.approx(row["ttft_ms"] / row["solo_ttft_ms"], rel=1e-3)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--streams", "2"], "--streams needs --interference"),
        (["--max-decode-gap-ms", "10"], "--max-decode-gap-ms needs --interference"),
        (["--interference", "64", "--batch", "1"], "drop --batch"),
        (["--interference", "64", "--multi-turn", "2"], "one of --multi-turn, --image and --interference"),
        (["--interference", "64", "--max-decode-gap-ms", "-1"], "must be > 0 ms"),
        (["--interference", "64", "--max-decode-gap-ms", "100,x"], "expected milliseconds"),
    ],
)
def test_flag_checks(extra: list[str], message: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(["bench", "--synthetic", "qwen3_6_tiny", "--device", "cpu", *extra])
        except SystemExit as exit:  # a value argparse refuses
            code = exit.code
    assert code != 0 and message in err.getvalue()
