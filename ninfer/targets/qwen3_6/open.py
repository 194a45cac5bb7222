"""Open the Qwen3.6 family's packages: Frontend from an artifact's resources, weights, the Program.

Reached only through `ninfer.targets.open` (which dispatches by the package's family); the family
Program's sizing and decode backend are decided here, once, at construction.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ninfer.runtime.contract.types import Program, ScoringProgram
from ninfer.targets.open import OpenedTarget, prefill_unit, resolve_device, resolve_dtype, resolve_lookahead
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources
from ninfer.targets.qwen3_6.impl.runtime.backends import DecodeBackend
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.weights import WeightGroup
from ninfer.types import EngineConfig, parse_speculative

# Without an explicit max_context a Program holds this many positions per request (bounded so the
# default KV pool stays small; the model itself allows variant.max_position_embeddings).
DEFAULT_MAX_CONTEXT = 32768
# the context cache's default share of the device memory left after the lanes and the working space, and
# its most checkpoint state slots (each holds every GDN layer's recurrent state of one frontier)
CUDA_CACHE_SHARE = 0.4
MAX_CHECKPOINT_SLOTS = 64


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
        groups.append("mtp")
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
    max_context = config.max_context or min(variant.max_position_embeddings, DEFAULT_MAX_CONTEXT)
    program = build_program(variant, view, config, max_context, device, dtype)
    return OpenedTarget(program, frontend, package.name, loaded.report)


def build_program(
    variant: Variant, view: ModelView, config: EngineConfig, max_context: int, device: torch.device,
    dtype: torch.dtype,
) -> Program:  # fmt: skip
    """The generation Program for an EngineConfig: a KV pool that holds ``max_context`` positions for
    every lane, refused with the flags to change when the model or the device cannot hold it."""
    from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program

    if max_context > variant.max_position_embeddings:
        raise ValueError(
            f"max_context {max_context} exceeds the model's {variant.max_position_embeddings} positions"
        )
    lookahead = resolve_lookahead(config.decode_lookahead, device)
    backend = decode_backend(config, lookahead, variant)
    # every lane can reach max_context, plus the positions a verify writes past its last token
    pages_per_seq = -(-(max_context + backend.extra_tokens) // config.page_size)
    lane_slots = backend.slots_per_sequence * config.max_concurrency
    lane_pages = pages_per_seq * config.max_concurrency
    extra = backend.kv_layers
    _check_state_memory(variant, config, device, dtype, lane_slots, lane_pages, max_context, extra)
    cache_slots, cache_pages = cache_resources(variant, config, device, dtype, lane_slots, lane_pages, extra)
    program_config = ProgramConfig(
        max_concurrency=config.max_concurrency,
        max_context=max_context,
        page_size=config.page_size,
        kv_pages=lane_pages + cache_pages,
        checkpoint_slots=cache_slots,
        device=device,
        dtype=dtype,
        cuda_graphs=config.cuda_graphs,
        kernels=config.kernels,
        decode_lookahead=lookahead,
        max_image_tokens=config.max_image_tokens if variant.vision is not None else 0,
    )
    return Qwen36Program(variant, view, program_config, backend=backend)


def decode_backend(config: EngineConfig, lookahead: bool, variant: Variant) -> DecodeBackend:
    """The Program's decode backend for ``config.speculative`` (docs/engine.md, "Decode backends")."""
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
    if not variant.mtp_num_hidden_layers:
        raise ValueError(f"speculative {config.speculative!r}: this model has no MTP layer")
    return MtpDraft(draft_tokens=spec.draft_tokens, layers=variant.mtp_num_hidden_layers)


def state_bytes(
    variant: Variant, num_slots: int, num_pages: int, page_size: int, dtype: torch.dtype,
    extra_layers: int = 0,
) -> int:  # fmt: skip
    """Bytes of the Program's StateStore (GDN conv + fp32 recurrent slots, K/V pages) and of the decode
    backend's ``extra_layers`` of KV in the same pages."""
    slot = StateStore.slot_bytes(variant, dtype)
    return num_slots * slot + num_pages * StateStore.page_bytes(variant, page_size, dtype, extra_layers)


def working_space(config: EngineConfig, device: torch.device, max_image_tokens: int) -> int:
    """Bytes to leave free beside the StateStore: activations (they grow with the prefill unit),
    sampling and graph pools, 2 GiB per 2048-token unit; the vision tower's, about 32 KiB per patch (4
    patches per image token) at its widest layer."""
    chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
    return 2 * 2**30 * max(1, -(-chunk // 2048)) + max_image_tokens * 4 * 32 * 2**10


def cache_resources(
    variant: Variant, config: EngineConfig, device: torch.device, dtype: torch.dtype, lane_slots: int,
    lane_pages: int, extra_layers: int = 0,
) -> tuple[int, int]:  # fmt: skip
    """State slots and KV pages for the context cache beyond the lanes' own (docs/resources-and-context-
    cache.md, "Sizing"): ``cache_memory_gb``, else on CUDA a share of the memory left free after the
    lanes and the working space, on CPU four times the lanes' state (at most 1 GiB). A quarter of the
    bytes goes to checkpoint state slots (at most ``MAX_CHECKPOINT_SLOTS``), the rest to KV pages."""
    if not config.prefix_cache:
        return 0, 0
    slot = StateStore.slot_bytes(variant, dtype)
    page = StateStore.page_bytes(variant, config.page_size, dtype, extra_layers)
    if config.cache_memory_gb is not None:
        budget = int(config.cache_memory_gb * 2**30)
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        lanes = lane_slots * slot + lane_pages * page
        working = working_space(config, device, config.max_image_tokens if variant.vision else 0)
        budget = int(CUDA_CACHE_SHARE * max(0, free - lanes - working))
    else:
        budget = min(2**30, 4 * (lane_slots * slot + lane_pages * page))
    slots = min(MAX_CHECKPOINT_SLOTS, budget // 4 // slot)
    return slots, max(0, (budget - slots * slot) // page)


def _check_state_memory(
    variant: Variant, config: EngineConfig, device: torch.device, dtype: torch.dtype, lane_slots: int,
    lane_pages: int, max_context: int, extra_layers: int = 0,
) -> None:  # fmt: skip
    """Refuse, with the flags to change, a lane KV pool (and an explicit cache budget) that cannot fit
    next to the weights."""
    if device.type != "cuda":
        return
    need = state_bytes(variant, lane_slots, lane_pages, config.page_size, dtype, extra_layers)
    cache = int(config.cache_memory_gb * 2**30) if config.prefix_cache and config.cache_memory_gb else 0
    free, _ = torch.cuda.mem_get_info(device)
    image_tokens = config.max_image_tokens if variant.vision is not None else 0
    headroom = working_space(config, device, image_tokens)
    if need + cache + headroom > free:
        gib = 2**30
        chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
        raise ValueError(
            f"the KV pool for max_context={max_context} x max_concurrency={config.max_concurrency} needs "
            f"{need / gib:.1f} GiB (+{cache / gib:.1f} GiB context cache, +{headroom / gib:.0f} GiB working "
            f"space for {chunk}-token prefill units) but {free / gib:.1f} GiB is free after the weights; "
            "lower --max-context, --max-concurrency or --cache-memory-gb"
        )
