"""`ninfer inspect FILE [--verify] [--json]`: output content and exit codes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from ninfer.artifact import Artifact, ArtifactWriter, TensorSpec
from ninfer.cli.inspect_cmd import human_bytes
from ninfer.cli.main import main
from ninfer.targets.registry import get_package

torch.set_num_threads(1)

TINY = get_package("qwen3_6_tiny")
H = TINY.variant.hidden_size
TENSORS = {
    "embed_tokens.weight": torch.randn(300, H).to(torch.bfloat16),
    "layers.3.linear_attn.A_log": torch.randn(6),
    "norm.weight": torch.randn(H).to(torch.bfloat16),
    "mtp.fc.weight": torch.randn(H, 2 * H).to(torch.bfloat16),
    "visual.patch_embed.proj.bias": torch.randn(32).to(torch.bfloat16),
}
PROVENANCE = {
    "converter": "ninfer_tools 0.1.0",
    "source_dtype": "bfloat16",
    "sources": [{"name": "model-00001.safetensors", "bytes": 4096}],
}


def write(path: Path, dims: dict | None = None) -> Path:
    specs = [TensorSpec(n, t.dtype, tuple(t.shape)) for n, t in TENSORS.items()]
    with ArtifactWriter(
        path,
        identity=TINY.identity("bf16"),
        dims=dims or TINY.variant.dims(),
        tensors=specs,
        frontend={"tokenizer.json": b'{"model": {}}', "chat_template": b"{{ m }}"},
        provenance=PROVENANCE,
    ) as w:
        for name, t in TENSORS.items():
            w.write_tensor(name, t)
    return path


def test_text_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.ninfer")
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    text_bytes = (300 * H + H) * 2 + 6 * 4
    assert f"package     qwen3_6_tiny: {TINY.description} (registered, dims match)" in lines
    assert "identity    family qwen3_6, package qwen3_6_tiny, storage profile bf16" in lines
    assert "hidden 64, 8 layers (6 GDN + 2 attention), vocab 248320, dense MLP 128" in out
    assert f"tensors     5 tensors, {human_bytes(text_bytes + 2 * H * H * 2 + 64)}" in lines
    assert f"  text      3 tensors, {human_bytes(text_bytes)}" in lines
    assert f"  mtp       1 tensors, {human_bytes(2 * H * H * 2)}" in lines
    assert "  vision    1 tensors, 64 B" in lines
    assert any(line.startswith("dtypes      bfloat16 x4 (") and "float32 x1 (24 B)" in line for line in lines)
    assert any(line.split()[:2] == ["tokenizer.json", "13"] for line in lines)
    assert '"source_dtype": "bfloat16"' in out
    assert "verified" not in out


def test_json_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.ninfer")
    assert main(["inspect", str(path), "--json", "--verify"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identity"] == TINY.identity("bf16")
    assert report["package"] == {
        "name": "qwen3_6_tiny",
        "description": TINY.description,
        "error": None,
        "features": {"vision": True, "mtp": True, "dflash": False, "off": {}},
    }
    assert report["dims"] == TINY.variant.dims()
    assert report["tensors"]["count"] == 5
    assert report["tensors"]["groups"]["mtp"] == {"count": 1, "bytes": 2 * H * H * 2}
    assert report["tensors"]["dtypes"]["float32"] == {"count": 1, "bytes": 24}
    assert report["frontend"]["chat_template"]["nbytes"] == 7
    assert report["provenance"] == PROVENANCE
    assert report["verified"] == {"tensors": 5, "resources": 2}
    with Artifact.open(path) as a:
        assert report["file_bytes"] == os.path.getsize(path) == a.file_bytes

    assert main(["inspect", str(path), "--verify"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "verified 5 tensors, 2 resources"


def test_verify_failure_exits_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "m.ninfer")
    with Artifact.open(path) as a:
        spot = a.payload_offset + a.descriptor("mtp.fc.weight").offset + 7
    raw = bytearray(path.read_bytes())
    raw[spot] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert main(["inspect", str(path)]) == 0  # header is intact: inspect without --verify still works
    capsys.readouterr()
    assert main(["inspect", str(path), "--verify"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    err = [line for line in captured.err.splitlines() if line.startswith("ninfer inspect:")]
    assert err == [
        f"ninfer inspect: error: {path}: tensor 'mtp.fc.weight': " + err[0].split("'mtp.fc.weight': ", 1)[1]
    ]
    assert "checksum mismatch" in err[0]


def test_identity_mismatch_reported_and_fails_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dims = TINY.variant.dims()
    dims["num_layers"] = 12
    path = write(tmp_path / "m.ninfer", dims=dims)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "package     does not bind: dims do not match package 'qwen3_6_tiny': num_layers: 8 != 12" in out
    assert main(["inspect", str(path), "--verify"]) == 1
    assert "num_layers: 8 != 12" in capsys.readouterr().err


def test_errors_exit_1_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """main() returning 1 (not raising) is what keeps tracebacks off the console."""
    missing = tmp_path / "missing.ninfer"
    assert main(["inspect", str(missing)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and "No such file" in captured.err
    bad = tmp_path / "bad.ninfer"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    assert main(["inspect", str(bad), "--verify"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert (
        captured.err == f"ninfer inspect: error: {bad}: not a .ninfer file (does not start with magic "
        "b'NINFER\\x00\\x00')\n"
    )


def test_human_bytes() -> None:
    assert human_bytes(0) == "0 B"
    assert human_bytes(1023) == "1023 B"
    assert human_bytes(1536) == "1.50 KiB (1,536 B)"
    assert human_bytes(54 * 2**30) == "54.00 GiB (57,982,058,496 B)"
