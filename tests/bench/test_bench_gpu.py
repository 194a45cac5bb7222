"""`ninfer bench` on CUDA at small settings: synthetic tiny packages (bf16, decode in CUDA graphs) and the
bundled demo model give sane reports whose figures sit below their measured floors' speed."""

from __future__ import annotations

import json

import pytest
import torch

from ninfer.bench.roofline import decode_step_bytes
from ninfer.cli.main import main
from ninfer.targets.registry import get_package

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

SETTINGS = ("--batch", "1,3,8", "--context", "200", "--decode-steps", "16", "--prefill-tokens", "1000",
            "--prefill-chunk", "256", "--device", "cuda", "--json")


def _bench(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    rc = main(["bench", *argv, *SETTINGS])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_synthetic_tiny_on_cuda(package: str, capsys: pytest.CaptureFixture[str]) -> None:
    report = _bench(capsys, "--synthetic", package)
    assert report["synthetic"] is True and report["dtype"] == "bfloat16"
    assert report["settings"]["cuda_graphs"] is True
    assert report["bandwidth_GBps"] > 100 and report["matmul_TFLOPs"] > 1
    variant = get_package(package).variant
    assert [r["batch"] for r in report["decode"]] == [1, 3, 8]
    for row in report["decode"]:
        assert row["bytes_step"] == decode_step_bytes(variant, row["batch"], 200, torch.bfloat16).total
        assert 0 < row["floor_ms"] < row["ms_step"] and row["steps"] == 16
    assert 0 < report["prefill"]["floor_ms"] < report["prefill"]["ms"]
    assert 0 < report["tpot_floor_ms"] < report["tpot_ms"] and report["ttft_ms"] > 0
    print(f"\n{package}: " + ", ".join(f"B={r['batch']} {r['ms_step']:.2f} ms" for r in report["decode"]))


def test_bundled_demo_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    report = _bench(capsys)
    assert report["package"] == "qwen3_6_demo" and report["synthetic"] is False
    assert report["dtype"] == "bfloat16"  # the artifact's storage dtype on a GPU
    for row in report["decode"]:
        assert 0 < row["floor_ms"] < row["ms_step"]


def _mode(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    capsys.readouterr()
    rc = main(["bench", "--synthetic", "qwen3_6_tiny", "--device", "cuda", "--json", *argv])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)


def test_multi_turn_on_cuda_times_captures_with_events(capsys: pytest.CaptureFixture[str]) -> None:
    report = _mode(capsys, "--multi-turn", "3", "--turn-tokens", "200", "--reply-tokens", "8",
                   "--context", "200", "--decode-steps", "16")  # fmt: skip
    turns = report["turns"]
    assert turns[0]["reused_tokens"] == 0
    assert all(t["reused_tokens"] >= t["expected_reused_min"] > 0 for t in turns[1:])
    assert all(t["cold_new"]["reused_tokens"] == 0 for t in turns)
    assert report["capture"]["timing"] == "cuda events" and report["capture"]["device_ms"]["median"] > 0
    assert report["decode"]["cache_off"]["ms_step"] > 0 and report["settings"]["cuda_graphs"] is True


def test_image_on_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    report = _mode(capsys, "--image", "448x448,1024x1024", "--image-repeats", "3")
    rows = report["images"]
    assert [r["image_tokens"] for r in rows] == [196, 1024]
    for row in rows:
        assert 0 < row["tower_floor_ms"] < row["tower_ms"] and row["ttft_image_ms"] > 0
