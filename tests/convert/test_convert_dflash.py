"""`ninfer convert --dflash DRAFTER_DIR`: a DFlash drafter checkpoint (z-lab's ``DFlashDraftModel``, saved
by the `dflash==0.1.0` reference's own ``save_pretrained``) joins the target's artifact.

- The drafter's tensors land bit-exactly under ``dflash.``; the artifact binds the package with the
  drafter on, and ``--speculative dflash:K`` decodes the plain greedy tokens from it.
- Without ``--dflash`` the artifact binds the package with the drafter off, its provenance unchanged
  (no ``features_off`` for a complete checkpoint), and ``dflash:K`` is refused at start naming why.
- A drafter whose config differs from the package's registered one is refused, naming the field; so is
  a folder that is not a drafter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from convert_ckpt_helpers import save_tiny_checkpoint
from ninfer_tools.convert.qwen3_6 import ConvertError, convert

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.artifact import Artifact
from ninfer.cli.main import main as cli_main
from ninfer.targets.identity import check_identity
from ninfer.targets.registry import PACKAGES

dflash_model = pytest.importorskip("dflash.model")

DENSE = "qwen3_6_tiny"


def save_drafter(path: Path, *, seed: int, **overrides: object) -> Path:
    from transformers import Qwen3Config

    package = PACKAGES[DENSE]
    dims = package.drafter
    assert dims is not None
    torch.manual_seed(seed)
    model = dflash_model.DFlashDraftModel(Qwen3Config(**{**dims.hf_config(package.variant), **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    model.to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkpoint(DENSE, tmp_path_factory.mktemp("hf") / "target", seed=5)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_drafter(tmp_path_factory.mktemp("hf") / "drafter", seed=7)


def test_the_drafter_joins_the_artifact_and_drafts(target: Path, drafter: Path, tmp_path: Path) -> None:
    out = tmp_path / "with.ninfer"
    assert cli_main(["convert", str(target), "-o", str(out), "--dflash", str(drafter), "--no-progress"]) == 0
    from safetensors.torch import load_file

    source = load_file(str(drafter / "model.safetensors"))
    with Artifact.open(out) as artifact:
        package = check_identity(artifact)
        assert package.has_dflash and package.features_off == ()
        for key, tensor in source.items():
            assert torch.equal(artifact.tensor(f"dflash.{key}"), tensor), key
        assert "features_off" not in artifact.provenance
        assert any(f["name"].startswith("dflash/") for f in artifact.provenance["source"]["files"])

    def greedy(spec: str | None) -> tuple[int, ...]:
        config = EngineConfig(device="cpu", dtype="float32", speculative=spec, warmup=False, max_context=256)
        with Engine(str(out), config) as engine:
            request = GenerationRequest(
                prompt=[5, 6, 7, 8, 9], max_tokens=12, temperature=0.0, ignore_eos=True
            )
            return engine.generate(request).token_ids

    assert greedy("dflash:5") == greedy(None)


def test_without_the_drafter_dflash_is_refused(target: Path, tmp_path: Path) -> None:
    out = convert(target, tmp_path / "without.ninfer", progress=False)
    with Artifact.open(out) as artifact:
        package = check_identity(artifact)
        assert not package.has_dflash and package.features_off == ()
        assert "features_off" not in artifact.provenance
    config = EngineConfig(
        device="cpu", dtype="float32", speculative="dflash:3", warmup=False, max_context=256
    )
    with pytest.raises(ValueError, match="no DFlash drafter weights: convert it with --dflash DRAFTER_DIR"):
        Engine(str(out), config)


def test_a_different_drafter_is_refused(target: Path, tmp_path: Path) -> None:
    wrong = save_drafter(tmp_path / "wrong", seed=1, sliding_window=32)
    with pytest.raises(
        ConvertError, match=r"does not match package 'qwen3_6_tiny'.*sliding_window: 32 != 16"
    ):
        convert(target, tmp_path / "out.ninfer", dflash_dir=wrong, progress=False)
    config = json.loads((wrong / "config.json").read_text())
    config["architectures"] = ["Qwen3ForCausalLM"]
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="not a DFlash drafter config"):
        convert(target, tmp_path / "out.ninfer", dflash_dir=wrong, progress=False)
