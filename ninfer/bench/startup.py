"""Start the Engine under test and time each start-up phase.

- From an artifact: ``open_target`` (load the weights, build the Program, capture the decode graphs),
  then ``Engine.from_parts`` (start the worker, run its warm-up request): exactly what ``Engine(path,
  config)`` does, split in two so both phases are timed.
- ``--synthetic PACKAGE``: random weights of the package's exact dims materialised directly on the
  device through the package's binder, the real Program over them, and the real Frontend (the bundled
  Qwen3.6 tokenizer and the package's chat template; for the demo package, the bundled demo artifact's
  own resources), wrapped with ``Engine.from_parts``.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ninfer.cli.common import BUNDLED_PACKAGE, bundled_artifact
from ninfer.runtime.engine.engine import Engine
from ninfer.targets.open import (
    artifact_package,
    build_program,
    load_frontend,
    open_target,
    resolve_device,
    resolve_dtype,
)
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources
from ninfer.targets.qwen3_6.variant import SpecialTokens
from ninfer.targets.registry import get_package
from ninfer.types import EngineConfig

# what real checkpoints of every package store (and so what --synthetic runs in on a GPU)
SYNTHETIC_STORAGE = torch.bfloat16


@dataclass
class StartedEngine:
    engine: Engine
    package: Package
    device: torch.device
    dtype: torch.dtype
    synthetic: bool
    artifact: str | None
    phases_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds, in order
    load: Any = None  # the weight loader's LoadReport (bytes, seconds, GB/s), artifacts only
    program: Any = None  # the Program under the Engine (its model view serves a second Engine)

    @property
    def startup_s(self) -> float:
        return sum(self.phases_s.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def start_from_artifact(path: str, config: EngineConfig) -> StartedEngine:
    package, storage = artifact_package(path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, storage, device)
    t0 = time.perf_counter()
    opened = open_target(path, config)
    _sync(device)
    t1 = time.perf_counter()
    engine = Engine.from_parts(opened.program, opened.frontend, config, package_name=opened.package_name)
    t2 = time.perf_counter()
    phases = {"load_and_program": t1 - t0, "worker_and_warmup": t2 - t1}
    return StartedEngine(
        engine, package, device, dtype, False, path, phases, opened.load_report, opened.program
    )


def synthetic_frontend(package: Package) -> Frontend:
    """The package's real Frontend without an artifact of it."""
    if package.name == BUNDLED_PACKAGE:
        return load_frontend(bundled_artifact())
    if package.variant.special != SpecialTokens():
        raise ValueError(f"package {package.name!r} has no bundled tokenizer (its special ids are its own)")
    from ninfer.targets.qwen3_6.resources import chat_template, tokenizer_json

    resources = FrontendResources(
        tokenizer_json=tokenizer_json(),
        chat_template=chat_template(package.chat_template),
        generation_config={},
    )
    return Frontend.from_resources(resources, package.variant.special, package.variant.vision)


def sizing_frontend(artifact: str | None, package: Package) -> Frontend:
    """The Frontend the Engine under test will have, before it starts (to size its requests)."""
    if artifact is not None:
        return load_frontend(artifact)  # type: ignore[return-value]
    return synthetic_frontend(package)


def start_synthetic(
    package_name: str, config: EngineConfig, *, seed: int, drafter: bool = False
) -> StartedEngine:
    """An Engine over random weights of ``package_name``; with its registered DFlash drafter's too (as an
    artifact converted with ``--dflash`` holds them) where ``config`` drafts with it or ``drafter`` says
    so (a sweep whose later Engines do)."""
    from ninfer.targets.qwen3_6.binder import random_model_view

    package = get_package(package_name)
    if drafter or (config.speculative or "").startswith("dflash:"):
        package = package.with_drafter()
    variant = package.variant
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, SYNTHETIC_STORAGE, device)
    t0 = time.perf_counter()
    view = random_model_view(variant, seed=seed, dtype=dtype, device=device)
    _sync(device)
    t1 = time.perf_counter()
    frontend = synthetic_frontend(package)
    t2 = time.perf_counter()
    program = build_program(package, view, config, config.max_context, device, dtype, frontend=frontend)
    _sync(device)
    t3 = time.perf_counter()
    engine = Engine.from_parts(program, frontend, config, package_name=package.name)
    t4 = time.perf_counter()
    phases = {"materialize": t1 - t0, "frontend": t2 - t1, "program": t3 - t2, "worker_and_warmup": t4 - t3}
    return StartedEngine(engine, package, device, dtype, True, None, phases, program=program)


def restart(started: StartedEngine, config: EngineConfig) -> StartedEngine:
    """Close ``started``'s Engine, let its Program go (on CUDA its memory back to the driver) and start
    another Engine with ``config`` over the same weights (the Program's model view) and Frontend: a
    second configuration without loading or materialising the weights again. ``started`` is spent."""
    view = started.program.view
    frontend = started.engine.frontend
    started.engine.close()
    started.engine = started.program = None  # type: ignore[assignment]
    gc.collect()
    if started.device.type == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    program = build_program(
        started.package, view, config, config.max_context, started.device, started.dtype, frontend=frontend
    )
    _sync(started.device)
    t1 = time.perf_counter()
    engine = Engine.from_parts(program, frontend, config, package_name=started.package.name)
    t2 = time.perf_counter()
    phases = {"program": t1 - t0, "worker_and_warmup": t2 - t1}
    return StartedEngine(
        engine, started.package, started.device, started.dtype, started.synthetic, started.artifact, phases,
        program=program,
    )  # fmt: skip
