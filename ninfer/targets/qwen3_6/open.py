"""Open the Qwen3.6 family's packages: Frontend from an artifact's resources, weights, the Program.

Reached only through `ninfer.targets.open` (which dispatches by the package's family); the family
Program's sizing and decode backend are decided here, once, at construction.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from typing import Any

import torch

from ninfer.runtime.contract.types import Program, ScoringProgram
from ninfer.targets.open import OpenedTarget, resolve_device, resolve_dtype, resolve_lookahead
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources
from ninfer.targets.qwen3_6.impl.runtime.backends import DecodeBackend
from ninfer.targets.qwen3_6.memory import plan_memory
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.weights import WeightGroup
from ninfer.types import EngineConfig, parse_speculative

log = logging.getLogger("ninfer.engine")


def frontend_from_artifact(artifact: Any, variant: Variant) -> Frontend:
    """The Frontend from an open artifact's resources (no weights touched); ``variant`` gives the special
    ids and the vision tower's dims (checked against the preprocessor's patch and merge sizes)."""

    def resource(name: str) -> bytes | None:
        return artifact.frontend_resource(name)

    tokenizer = resource("tokenizer.json")
    template = resource("chat_template")
    if tokenizer is None or template is None:
        missing = [n for n, v in (("tokenizer.json", tokenizer), ("chat_template", template)) if v is None]
        raise ValueError(f"{artifact.path}: artifact lacks frontend resource(s) {missing}")
    generation = resource("generation_config.json")
    preprocessor = resource("preprocessor_config.json")
    return Frontend.from_resources(
        FrontendResources(
            tokenizer_json=tokenizer,
            chat_template=template.decode("utf-8"),
            generation_config=json.loads(generation) if generation else {},
            preprocessor_config=json.loads(preprocessor) if preprocessor else None,
        ),
        variant.special,
        variant.vision,
    )


def open_artifact(
    artifact_path: str, package: Package, config: EngineConfig, storage: torch.dtype
) -> OpenedTarget:
    """Weights to the device, the Program for ``config.purpose``, the Frontend."""
    from ninfer.artifact import Artifact
    from ninfer.targets.qwen3_6.binder import load_model

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, storage, device)
    # the MTP layer only where it drafts; the vision tower wherever the package has one
    groups: list[WeightGroup] = ["text", "vision"]
    spec = parse_speculative(config.speculative) if config.purpose == "generation" else None
    if spec is not None and spec.method == "mtp":
        if not package.has_mtp:  # refused before any weight is read
            raise ValueError(
                f"speculative {config.speculative!r}: this model has no MTP layer "
                f"({package.missing_feature('mtp')}); drop speculative"
            )
        groups.append("mtp")
    if spec is not None and spec.method == "dflash":
        if not package.has_dflash:
            raise ValueError(
                f"speculative {config.speculative!r}: this model has no DFlash drafter "
                f"({package.missing_feature('dflash')}); drop speculative"
            )
        groups.append("dflash")
    loaded = load_model(artifact_path, device, dtype, groups=groups)
    view = loaded.view
    with Artifact.open(artifact_path) as artifact:
        frontend = frontend_from_artifact(artifact, package.variant)
    variant = package.variant
    program: Program | ScoringProgram
    if config.purpose == "causal_scoring":
        from ninfer.targets.qwen3_6.impl.runtime.scoring import Qwen36ScoringProgram

        program = Qwen36ScoringProgram(
            variant,
            view,
            window=config.score_window,
            page_size=config.page_size,
            device=device,
            dtype=dtype,
            kernels=config.kernels,
        )
        return OpenedTarget(program, frontend, package.name, loaded.report)
    program = build_program(variant, view, config, config.max_context, device, dtype, frontend=frontend)
    return OpenedTarget(program, frontend, package.name, loaded.report)


# the host tier may take at most this share of the machine's physical memory (pinned memory cannot be
# swapped out: more would starve the process and the others beside it)
HOST_TIER_SHARE = 0.8


def physical_memory() -> int:
    """Bytes of physical memory of the machine (0 when the platform does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def build_program(
    variant: Variant, view: ModelView, config: EngineConfig, max_context: int | None, device: torch.device,
    dtype: torch.dtype, *, frontend: Frontend | None = None,
) -> Program:  # fmt: skip
    """The generation Program for an EngineConfig, its pools sized by `plan_memory` (``max_context``:
    None takes the plan's default) from the memory free after the weights (CUDA); refused, with the
    numbers and the flags to change, when the state cannot fit. ``frontend``: the Engine's, whose image
    preprocessing turns ``config.vision_graph_sizes`` into the grids the Program captures."""
    from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program

    lookahead = resolve_lookahead(config.decode_lookahead, device)
    backend = decode_backend(config, lookahead, variant)
    grids = vision_graph_grids(config, variant, frontend, device)
    free, total = device_memory(device)
    plan = plan_memory(
        variant, config, backend, device=device, dtype=dtype, max_context=max_context, free_bytes=free,
        total_bytes=total, vision_graph_grids=grids,
    )  # fmt: skip
    host_memory = physical_memory()
    if plan.host_bytes and host_memory and plan.host_bytes > HOST_TIER_SHARE * host_memory:
        raise ValueError(
            f"the host tier (--host-cache-gb {config.host_cache_gb:g}) takes "
            f"{plan.host_bytes / 2**30:.1f} GiB of host memory, more than {HOST_TIER_SHARE:g} of the "
            f"machine's {host_memory / 2**30:.1f} GiB; lower --host-cache-gb"
        )
    shorter = plan.context_from == "fits"
    log.log(logging.WARNING if shorter else logging.INFO, "memory plan: %s", plan.describe())
    program_config = ProgramConfig(
        max_concurrency=config.max_concurrency,
        max_context=plan.max_context,
        page_size=config.page_size,
        kv_pages=plan.kv_pages,
        checkpoint_slots=plan.checkpoint_slots,
        host_checkpoint_slots=plan.host_slots,
        host_kv_pages=plan.host_pages,
        device=device,
        dtype=dtype,
        cuda_graphs=config.cuda_graphs,
        prefill_graph_tokens=config.prefill_graph_tokens,
        kernels=config.kernels,
        decode_lookahead=lookahead,
        max_image_tokens=config.max_image_tokens if variant.vision is not None else 0,
        vision_graph_grids=grids,
        memory=plan,
    )
    program = Qwen36Program(variant, view, program_config, backend=backend)
    if device.type == "cuda":
        after, _ = torch.cuda.mem_get_info(device)
        log.info(
            "after the Program (pools, graphs): %.1f GiB free on the device, %.1f GiB planned as working "
            "space",
            after / 2**30, plan.working_bytes / 2**30,
        )  # fmt: skip
    return program


def vision_graph_grids(
    config: EngineConfig, variant: Variant, frontend: Frontend | None, device: torch.device
) -> tuple[tuple[int, int, int], ...]:
    """The grids of ``config.vision_graph_sizes`` as the Frontend resizes those images (none without CUDA
    graphs or a vision tower); refused without a Frontend to say them."""
    if not (config.vision_graph_sizes and config.cuda_graphs and device.type == "cuda" and variant.vision):
        return ()
    if frontend is None:
        raise ValueError("vision_graph_sizes needs the Engine's Frontend (its image preprocessing)")
    from ninfer.targets.qwen3_6.frontend.vision import image_grid

    return tuple(dict.fromkeys(image_grid(w, h, frontend.image_config) for w, h in config.vision_graph_sizes))


def device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a CUDA device after what no longer has an owner went back to the driver
    (an earlier Program of this process, the load's staging buffers); (0, 0) elsewhere."""
    if device.type != "cuda":
        return 0, 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def decode_backend(config: EngineConfig, lookahead: bool, variant: Variant) -> DecodeBackend:
    """The Program's decode backend for ``config.speculative`` (docs/engine.md, "Decode backends")."""
    from ninfer.targets.qwen3_6.impl.runtime.backends.dflash import DFlashDraft
    from ninfer.targets.qwen3_6.impl.runtime.backends.known import KnownContinuation, scripted_acceptance
    from ninfer.targets.qwen3_6.impl.runtime.backends.mtp import MtpDraft
    from ninfer.targets.qwen3_6.impl.runtime.backends.plain import PlainDecode

    spec = parse_speculative(config.speculative)
    if spec is None:
        return PlainDecode(lookahead=lookahead)
    if spec.method == "known":
        assert spec.mean_accepted is not None
        return KnownContinuation(
            draft_tokens=spec.draft_tokens,
            continuation=lambda seq: (),
            acceptance=scripted_acceptance(spec.mean_accepted),
        )
    head = min(config.draft_vocab or variant.vocab_size, variant.vocab_size)
    if spec.method == "dflash":
        if variant.dflash is None:
            raise ValueError(f"speculative {config.speculative!r}: this model has no DFlash drafter")
        return DFlashDraft(draft_tokens=spec.draft_tokens, dims=variant.dflash, head_rows=head)
    if not variant.mtp_num_hidden_layers:
        raise ValueError(f"speculative {config.speculative!r}: this model has no MTP layer")
    return MtpDraft(draft_tokens=spec.draft_tokens, layers=variant.mtp_num_hidden_layers, head_rows=head)


def state_bytes(
    variant: Variant, num_slots: int, num_pages: int, page_size: int, dtype: torch.dtype,
    extra_layers: int = 0,
) -> int:  # fmt: skip
    """Bytes of the Program's StateStore (GDN conv + fp32 recurrent slots, K/V pages) and of the decode
    backend's ``extra_layers`` of KV in the same pages."""
    slot = StateStore.slot_bytes(variant, dtype)
    return num_slots * slot + num_pages * StateStore.page_bytes(variant, page_size, dtype, extra_layers)
