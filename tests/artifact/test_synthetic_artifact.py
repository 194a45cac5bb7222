"""`tools/synthetic_artifact.py`: random-weight `.ninfer` files of a package's exact dims.

The tiny packages are written on CPU and must (1) pass the reader's full checksum verification, (2) hold
bit-for-bit the tensors `random_model_view` draws for the same seed (fp32-pinned ones in fp32), with
the package's identity, dims and real frontend resources, and (3) open in the public Engine, whose
greedy tokens equal transformers' on the same weights. Refusals (existing path, too little disk
space, unknown package) happen before any file is created, and the CLI exits 2 for them.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from ninfer_tools import synthetic_artifact as tool
from tiny_artifacts import SEED, hf_causal_lm

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.artifact import Artifact
from ninfer.targets.qwen3_6.binder import random_model_view
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES

PACKAGE_NAMES = ("qwen3_6_tiny", "qwen3_6_tiny_moe")
PROMPT = [785, 3974, 13876, 38835, 34208]
NEW_TOKENS = 3


def _write(name: str, path: Path, storage: str) -> tool.WriteReport:
    report = tool.write_synthetic_artifact(name, path, seed=SEED, storage=storage, device="cpu")
    mb_per_s = report.file_bytes / report.seconds / 1e6
    print(
        f"{name} {storage}: {report.file_bytes / 1e6:.1f} MB in {report.seconds:.2f} s ({mb_per_s:.0f} MB/s)"
    )
    return report


@pytest.mark.parametrize("storage", ["fp32", "bf16"])
@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_artifact_verifies_and_holds_the_binders_random_weights(
    tmp_path: Path, name: str, storage: str
) -> None:
    package = PACKAGES[name]
    path = tmp_path / f"{name}.ninfer"
    report = _write(name, path, storage)
    assert report.tensors == len(weight_schema(package.variant))
    assert not Path(str(path) + ".partial").exists()
    dtype = torch.float32 if storage == "fp32" else torch.bfloat16
    expected = random_model_view(package.variant, seed=SEED, dtype=dtype, device="cpu").tensors
    with Artifact.open(path, verify=True) as artifact:  # every tensor's and resource's CRC-32
        assert artifact.identity == package.identity(storage)
        assert artifact.dims == package.variant.dims()
        assert artifact.provenance["synthetic"] is True and artifact.provenance["seed"] == SEED
        assert artifact.file_bytes == report.file_bytes == path.stat().st_size
        assert artifact.tensor_names() == [s.name for s in weight_schema(package.variant)]
        for spec in weight_schema(package.variant):
            stored = artifact.tensor(spec.name)
            assert stored.dtype == (torch.float32 if spec.keep_fp32 else dtype), spec.name
            assert torch.equal(stored, expected[spec.name]), spec.name
        assert artifact.frontend_resource("tokenizer.json") == (RESOURCE_DIR / "tokenizer.json").read_bytes()
        template = artifact.frontend_resource("chat_template")
        assert template == (RESOURCE_DIR / f"{package.chat_template}.jinja").read_bytes()
        generation = json.loads(artifact.frontend_resource("generation_config.json") or b"")
        assert generation["eos_token_id"] == list(package.variant.special.eos)


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_engine_opens_it_and_greedy_tokens_equal_transformers(tmp_path: Path, name: str) -> None:
    path = tmp_path / f"{name}.ninfer"
    _write(name, path, "fp32")  # SEED + fp32 on CPU: the very weights of tiny_artifacts' HF oracle
    config = EngineConfig(max_concurrency=1, device="cpu", dtype="float32", max_context=64, warmup=False)
    with Engine(path, config) as engine:
        result = engine.generate(
            GenerationRequest(prompt=PROMPT, max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        )
    with torch.no_grad():
        out = hf_causal_lm(name).generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert result.finish_reason == "length"
    assert list(result.token_ids) == out[0, len(PROMPT) :].tolist()


def test_refuses_an_existing_path_and_leaves_it_alone(tmp_path: Path) -> None:
    path = tmp_path / "taken.ninfer"
    path.write_bytes(b"keep me")
    with pytest.raises(tool.SyntheticArtifactError, match="already exists"):
        tool.write_synthetic_artifact("qwen3_6_tiny", path, device="cpu")
    assert path.read_bytes() == b"keep me"
    assert tool.main(["qwen3_6_tiny", str(path), "--device", "cpu"]) == 2
    assert path.read_bytes() == b"keep me"


def test_refuses_when_the_disk_lacks_space(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = PACKAGES["qwen3_6_tiny"]
    needed = tool.required_bytes(tool.tensor_specs(package, "bf16"), tool.frontend_resources(package))
    assert needed > sum(s.nbytes for s in tool.tensor_specs(package, "bf16"))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * needed, 9 * needed, needed - 1))
    path = tmp_path / "big.ninfer"
    with pytest.raises(tool.SyntheticArtifactError, match=r"bytes\) free"):
        tool.write_synthetic_artifact("qwen3_6_tiny", path, device="cpu")
    assert tool.main(["qwen3_6_tiny", str(path), "--device", "cpu"]) == 2
    assert list(tmp_path.iterdir()) == []  # neither the file nor a .partial
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10 * needed, 9 * needed, needed))
    tool.write_synthetic_artifact("qwen3_6_tiny", path, device="cpu")  # exactly enough is enough
    assert path.is_file()


def test_refuses_unknown_package_and_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(tool.SyntheticArtifactError, match="unknown package"):
        tool.write_synthetic_artifact("qwen9_nope", tmp_path / "x.ninfer", device="cpu")
    with pytest.raises(tool.SyntheticArtifactError, match="does not exist"):
        tool.write_synthetic_artifact("qwen3_6_tiny", tmp_path / "no" / "x.ninfer", device="cpu")
    assert list(tmp_path.iterdir()) == []


def test_cli_writes_the_file_and_reports(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cli.ninfer"
    started = time.perf_counter()
    assert tool.main(["qwen3_6_tiny_moe", str(path), "--device", "cpu", "--seed", "3"]) == 0
    elapsed = time.perf_counter() - started
    out, err = capsys.readouterr()
    assert out.strip().endswith(str(path)) and f"wrote {path.stat().st_size} bytes" in out
    assert "tensor 124/124" in err
    with Artifact.open(path) as artifact:
        assert artifact.identity["storage_profile"] == "bf16"
        assert artifact.provenance["seed"] == 3
    print(f"CLI wrote {path.stat().st_size / 1e6:.1f} MB in {elapsed:.2f} s")


@pytest.mark.parametrize("where", ["draw", "write"])
def test_a_failure_mid_way_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """Drawing fails on the calling thread, writing on the writer thread: either way the error surfaces,
    nothing hangs, and neither the file nor its .partial remains."""
    calls = {"n": 0}

    def fail_on_the_fifth(real: object) -> object:
        def wrapped(*args: object, **kwargs: object) -> object:
            calls["n"] += 1
            if calls["n"] == 5:
                raise RuntimeError(f"injected {where} failure")
            return real(*args, **kwargs)  # type: ignore[operator]

        return wrapped

    if where == "draw":
        monkeypatch.setattr(tool, "_draw", fail_on_the_fifth(tool._draw))
    else:
        monkeypatch.setattr(
            tool.ArtifactWriter, "write_tensor", fail_on_the_fifth(tool.ArtifactWriter.write_tensor)
        )
    with pytest.raises(RuntimeError, match=f"injected {where} failure"):
        tool.write_synthetic_artifact("qwen3_6_tiny", tmp_path / "x.ninfer", device="cpu")
    assert list(tmp_path.iterdir()) == []
