"""The bundled demo model: ships inside the package, verifies, and runs the README's first command."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest

from ninfer.artifact import Artifact
from ninfer.cli.common import bundled_artifact
from ninfer.cli.main import main
from ninfer.targets.identity import check_identity

# greedy completion of "def fibonacci(n):" (raw, 48 tokens, the model's default repetition penalty 1.1)
FIBONACCI_TOKENS = [
    807,
    198,
    261,
    345,
    370,
    69,
    1041,
    815,
    1102,
    11,
    296,
    349,
    258,
    318,
    402,
    323,
    285,
    783,
    276,
    261,
    522,
    1417,
    491,
    4784,
    959,
    273,
    694,
    15,
    92,
    840,
    670,
    258,
    345,
    370,
    69,
    1041,
    815,
    1102,
    11,
    296,
    11,
    296,
    980,
    503,
    287,
    1041,
    815,
    715,
]


def test_bundled_artifact_is_small_and_verifies() -> None:
    path = Path(bundled_artifact())
    assert path.is_file() and path.stat().st_size <= 24 * 2**20
    with Artifact.open(path, verify=True) as artifact:
        assert check_identity(artifact).name == "qwen3_6_demo"
        assert {"tokenizer.json", "chat_template", "generation_config.json"} <= set(artifact.frontend_names())
    assert main(["inspect", str(path), "--verify"]) == 0


def test_readme_first_command_is_stable(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "def fibonacci(n):", "--raw", "--temperature", "0", "--max-tokens", "48", "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "bundled demo model qwen3_6_demo" in captured.err
    assert result["token_ids"] == FIBONACCI_TOKENS
    assert result["text"].startswith(" pass\n        return ") and result["finish_reason"] == "length"


def test_score_on_held_out_stdlib_source(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = Path(sysconfig.get_paths()["stdlib"]) / "json" / "scanner.py"  # held out from training
    if not source.is_file():
        pytest.skip("no json/scanner.py in this Python's standard library")
    text = source.read_text(encoding="utf-8")
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert main(["score", "-", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["logprobs"][0] is None and len(out["logprobs"]) == len(out["token_ids"])
    assert math.isclose(out["total_nll"], -sum(out["logprobs"][1:]), rel_tol=1e-9)
    bits_per_byte = out["total_nll"] / math.log(2) / len(text.encode())
    assert bits_per_byte < 1.5, bits_per_byte  # a trained model, not noise (random weights give ~13)
