"""`.ninfer` artifacts of the tiny test packages with random weights, written through ArtifactWriter.

The weights are `random_model_view(variant, seed=SEED)` (norms randomised), so a test can rebuild the
same view, or the same transformers model through `hf_state_dict`, as its oracle. Frontend resources
are the real Qwen3.6 tokenizer and chat template from ninfer/targets/qwen3_6/resources.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch
from ninfer_tools.synthetic_artifact import frontend_resources

from ninfer.artifact import ArtifactWriter, TensorSpec
from ninfer.targets.qwen3_6.binder import dflash_state_dict, hf_state_dict, random_model_view
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.registry import PACKAGES

FIXTURES = Path(__file__).parent / "fixtures"
SEED = 20261129


@functools.cache
def tiny_view(package_name: str, drafter: bool = False) -> ModelView:
    """fp32 CPU random weights of a tiny package; ``drafter``: with its registered DFlash drafter's (the
    other tensors are the same: each draws from its own (seed, name) stream)."""
    package = PACKAGES[package_name]
    variant = (package.with_drafter() if drafter else package).variant
    return random_model_view(variant, seed=SEED, dtype=torch.float32, device="cpu")


def with_drafter(view: ModelView, package_name: str) -> ModelView:
    """``view`` (the package's weights, its bound parts perhaps edited: `dataclasses.replace` leaves
    ``tensors`` as they were) plus `tiny_view`'s drafter weights."""
    full = tiny_view(package_name, drafter=True)
    drafter = {name: t for name, t in full.tensors.items() if name.startswith("dflash.")}
    return dataclasses.replace(
        view, variant=full.variant, dflash=full.dflash, tensors={**view.tensors, **drafter}
    )


def write_tiny_artifact(package_name: str, path: Path, drafter: bool = False) -> Path:
    package = PACKAGES[package_name].with_drafter() if drafter else PACKAGES[package_name]
    tensors = tiny_view(package_name, drafter).tensors
    specs = [TensorSpec(s.name, tensors[s.name].dtype, s.shape) for s in weight_schema(package.variant)]
    frontend = frontend_resources(package)  # the real tokenizer and template, Qwen3.6's sampling defaults
    with ArtifactWriter(
        path,
        identity=package.identity("fp32"),
        dims=package.variant.dims(),
        tensors=specs,
        frontend=frontend,
        provenance={"source": "tests/tiny_artifacts.py", "seed": SEED},
    ) as writer:
        for spec in specs:
            writer.write_tensor(spec.name, tensors[spec.name])
    return path


@functools.cache
def hf_causal_lm(package_name: str, attention: str = "eager") -> torch.nn.Module:
    """transformers' Qwen3_5(Moe)ForCausalLM holding `tiny_view`'s weights (the oracle); ``attention``:
    its attention implementation (``sdpa`` for long prompts: eager holds every [T, T] score at once)."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    package = PACKAGES[package_name]
    text = package.hf_config()["text_config"]
    config, cls = (
        (Qwen3_5MoeTextConfig(**text), Qwen3_5MoeForCausalLM)
        if package.variant.moe
        else (Qwen3_5TextConfig(**text), Qwen3_5ForCausalLM)
    )
    config._attn_implementation = attention
    model = cls(config).float().eval()
    model.load_state_dict(hf_state_dict(tiny_view(package_name), text_only=True), strict=True)
    return model


def reference_drafter(view: ModelView) -> torch.nn.Module:
    """z-lab's `DFlashDraftModel` (`dflash==0.1.0`, the DFlash oracle; its test modules importorskip it)
    holding ``view``'s drafter weights, fp32, SDPA attention."""
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    dims = view.variant.dflash
    assert dims is not None
    config = Qwen3Config(**dims.hf_config(view.variant))
    config._attn_implementation = "sdpa"
    model = DFlashDraftModel(config).float().eval()
    model.load_state_dict(dflash_state_dict(view), strict=True)
    return model
