"""Open a package: its Program and Frontend from a `.ninfer` artifact and an `EngineConfig`.

This is the single seam between the model-free Engine and the targets: the Engine facade calls
`open_target` once, at construction, and from then on talks to the returned objects through the
runtime contracts only. It knows no family: the artifact's identity names a registered package, whose
family module (the closed `registry.family_module` table) opens it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ninfer.runtime.contract.frontend import FrontendLike
from ninfer.types import EngineConfig, default_prefill_chunk

if TYPE_CHECKING:
    from ninfer.runtime.contract.types import Program, ScoringProgram
    from ninfer.targets.package import Package


@dataclass(frozen=True)
class OpenedTarget:
    program: Program | ScoringProgram  # generation or causal_scoring, as the config's purpose says
    frontend: FrontendLike
    package_name: str
    load_report: Any = None  # artifact.loader.LoadReport: bytes, seconds and GB/s of the weight load


def resolve_kernels(device: torch.device, requested: str = "auto") -> str:
    """Which op table ``requested`` means on ``device``: ``auto`` is ``fast`` on CUDA and ``reference``
    elsewhere; ``reference`` / ``fast`` force one (``fast`` needs CUDA)."""
    if requested not in ("auto", "reference", "fast"):
        raise ValueError(f"kernels must be 'auto', 'reference' or 'fast', not {requested!r}")
    if requested == "reference" or (requested == "auto" and device.type != "cuda"):
        return "reference"
    if device.type != "cuda":
        raise ValueError("the fast kernels need a CUDA device")
    return "fast"


def prefill_unit(requested: int | None, device: torch.device, kernels: str) -> int:
    """Prompt tokens per prefill unit: ``requested``, or the default of the op table ``kernels`` selects
    on ``device`` (what the Engine resolves from the Program it is given)."""
    return requested or default_prefill_chunk(resolve_kernels(device, kernels))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA device is available")
    return torch.device(device)


def resolve_lookahead(requested: bool | None, device: torch.device) -> bool:
    """EngineConfig.decode_lookahead: ``None`` is on where the host's time between steps is GPU idle
    time it can hide (CUDA); on CPU the host computes the step itself, so there is nothing to hide."""
    return device.type == "cuda" if requested is None else requested


def resolve_dtype(dtype: str, storage: torch.dtype, device: torch.device) -> torch.dtype:
    if dtype != "auto":
        return getattr(torch, dtype)
    # CPU reference path computes in fp32 (bf16 matmuls on CPU are slow and less exact)
    return torch.float32 if device.type == "cpu" else storage


def artifact_package(artifact_path: str) -> tuple[Package, torch.dtype]:
    """The registered package an artifact binds to and its storage dtype (its header only)."""
    from ninfer.artifact import Artifact
    from ninfer.targets.identity import check_identity
    from ninfer.targets.package import STORAGE_PROFILES

    with Artifact.open(artifact_path) as artifact:
        package = check_identity(artifact)
        return package, getattr(torch, STORAGE_PROFILES[artifact.identity["storage_profile"]])


def load_frontend(artifact_path: str) -> FrontendLike:
    """The package's Frontend from the artifact's resources (no weights touched)."""
    from ninfer.artifact import Artifact
    from ninfer.targets.identity import check_identity
    from ninfer.targets.registry import family_module

    with Artifact.open(artifact_path) as artifact:
        package = check_identity(artifact)
        return family_module(package).frontend_from_artifact(artifact, package.variant)


def open_target(artifact_path: str, config: EngineConfig) -> OpenedTarget:
    from ninfer.targets.registry import family_module

    package, storage = artifact_package(artifact_path)
    return family_module(package).open_artifact(artifact_path, package, config, storage)


def build_program(
    package: Package, view: Any, config: EngineConfig, max_context: int | None, device: torch.device,
    dtype: torch.dtype, *, frontend: Any = None,
) -> Program:  # fmt: skip
    """The generation Program of ``package`` over a bound model ``view`` (synthetic weights);
    ``max_context`` None takes the family's default (sized from the device memory on CUDA); ``frontend``:
    the Engine's (its image preprocessing sizes the vision graphs)."""
    from ninfer.targets.registry import family_module

    return family_module(package).build_program(
        package.variant, view, config, max_context, device, dtype, frontend=frontend
    )
