"""`ninfer bench --image` on CPU with synthetic tiny weights: a row per size with the processor's grid,
the tower's time beside its FLOP floor (the roofline's count at the measured matmul rate) and the TTFT of
a one-image prompt beside a text prompt of the same token count."""

from __future__ import annotations

import contextlib
import io
import json
import math
from typing import Any

import pytest
import torch

from ninfer.bench.image import parse_sizes, random_image
from ninfer.bench.roofline import vision_flops
from ninfer.cli.main import main
from ninfer.targets.registry import get_package

torch.set_num_threads(1)
ARGS = (
    "bench",
    "--synthetic",
    "qwen3_6_tiny",
    "--image",
    "64x64,300x200",
    "--image-repeats",
    "2",
    "--device",
    "cpu",
)


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([*ARGS, "--json"])
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue())


def test_a_row_per_size_with_the_processor_grid(report: dict[str, Any]) -> None:
    assert report["mode"] == "image" and report["package"] == "qwen3_6_tiny" and report["synthetic"]
    rows = report["images"]
    assert [r["size"] for r in rows] == ["64x64", "300x200"]
    # 64 x 64 is below the processor's 256^2 minimum: resized up to 256 x 256, 16 x 16 patches
    assert rows[0]["grid_thw"] == [1, 16, 16]
    assert rows[1]["grid_thw"] == [1, 14, 20]  # 300 x 200 scaled into [256^2, ...] at multiples of 32
    for row in rows:
        t, h, w = row["grid_thw"]
        assert row["patches"] == t * h * w and row["image_tokens"] == t * h * w // 4
        assert row["prompt_tokens"] > row["image_tokens"]
        assert row["repeats"] == 2
    s = report["settings"]
    assert s["sizes"] == ["64x64", "300x200"] and s["prefix_cache"] is False
    assert s["max_image_tokens"] == max(r["image_tokens"] for r in rows)


def test_tower_beside_its_flop_floor(report: dict[str, Any]) -> None:
    dims = get_package("qwen3_6_tiny").variant.vision
    assert dims is not None
    peak = report["matmul_TFLOPs"] * 1e12
    for row in report["images"]:
        flops = vision_flops(dims, [tuple(row["grid_thw"])])
        assert row["tower_flops"] == flops.total
        assert row["tower_flops_by_part"]["attention"] == flops.attention
        assert sum(row["tower_flops_by_part"].values()) == flops.total
        assert math.isclose(row["tower_floor_ms"], flops.total / peak * 1e3, rel_tol=2e-3)
        assert 0 < row["tower_ms_min"] <= row["tower_ms"] <= row["tower_ms_max"]
        assert math.isclose(
            row["tower_pct_floor"], 100 * row["tower_floor_ms"] / row["tower_ms"], rel_tol=2e-3
        )
        assert row["tower_TFLOPs"] > 0


def test_ttft_of_image_and_text_prompts(report: dict[str, Any]) -> None:
    for row in report["images"]:
        for key in (
            "ttft_image_ms",
            "submit_image_ms",
            "prefill_image_ms",
            "ttft_text_ms",
            "prefill_text_ms",
        ):
            assert row[key] > 0, key
        assert row["ttft_image_ms"] >= row["submit_image_ms"]
        assert math.isclose(
            row["ttft_image_minus_text_ms"], row["ttft_image_ms"] - row["ttft_text_ms"], abs_tol=2e-3
        )
        assert row["ttft_floor_ms"] > row["tower_floor_ms"]  # the prompt's prefill FLOPs come on top


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main([*ARGS[:4], "64x64", *ARGS[5:]]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ninfer bench --image: qwen3_6_tiny on cpu")
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["size", "grid"])
    assert lines[header + 1].split()[:3] == ["64x64", "1x16x16", "64"]
    assert lines[header + 2] == ""


def test_sizes_and_images() -> None:
    assert parse_sizes("448x448, 1024X768") == ((448, 448), (1024, 768))
    for bad in ("", "448", "x4", "0x4", "4x-4", "1x201"):
        with pytest.raises(ValueError):
            parse_sizes(bad)
    image = random_image(30, 20, seed=1)
    assert image.pixels.shape == (20, 30, 3)
    assert random_image(30, 20, seed=1).digest == image.digest != random_image(30, 20, seed=2).digest
