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
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.types import EngineConfig

# Without an explicit max_context a Program holds this many positions per request (bounded so the
# default KV pool stays small; the model itself allows variant.max_position_embeddings).
DEFAULT_MAX_CONTEXT = 32768


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
    loaded = load_model(artifact_path, device, dtype)
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
    backend = decode_backend(config, lookahead)
    # every lane can reach max_context, plus the positions a verify writes past its last token
    pages_per_seq = -(-(max_context + backend.extra_tokens) // config.page_size)
    program_config = ProgramConfig(
        max_concurrency=config.max_concurrency,
        max_context=max_context,
        page_size=config.page_size,
        kv_pages=pages_per_seq * config.max_concurrency,
        device=device,
        dtype=dtype,
        cuda_graphs=config.cuda_graphs,
        kernels=config.kernels,
        decode_lookahead=lookahead,
        max_image_tokens=config.max_image_tokens if variant.vision is not None else 0,
    )
    _check_state_memory(variant, config, program_config, max_context, backend.slots_per_sequence)
    return Qwen36Program(variant, view, program_config, backend=backend)


def decode_backend(config: EngineConfig, lookahead: bool) -> DecodeBackend:
    """The Program's decode backend for ``config.speculative`` (docs/engine.md, "Decode backends")."""
    from ninfer.targets.qwen3_6.impl.runtime.backends.known import KnownContinuation, scripted_acceptance
    from ninfer.targets.qwen3_6.impl.runtime.backends.plain import PlainDecode
    from ninfer.types import parse_speculative

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
    raise ValueError(f"speculative {config.speculative!r}: the MTP backend is not built yet")


def state_bytes(variant: Variant, num_slots: int, num_pages: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of the Program's StateStore: GDN conv + fp32 recurrent slots, and K/V pages."""
    elem = torch.empty((), dtype=dtype).element_size()
    n_gdn, n_attn = len(variant.gdn_layers), len(variant.attention_layers)
    conv = n_gdn * num_slots * variant.conv_dim * (variant.linear_conv_kernel_dim - 1) * elem
    rec = n_gdn * num_slots * variant.linear_num_value_heads * variant.linear_key_head_dim
    rec *= variant.linear_value_head_dim * 4
    kv = 2 * n_attn * num_pages * page_size * variant.num_kv_heads * variant.head_dim * elem
    return conv + rec + kv


def _check_state_memory(
    variant: Variant, config: EngineConfig, program: Any, max_context: int, slots_per_sequence: int
) -> None:
    """Refuse, with the flags to change, a KV pool that cannot fit next to the weights."""
    device = program.device
    if device.type != "cuda":
        return
    slots = slots_per_sequence * program.max_concurrency
    need = state_bytes(variant, slots, program.kv_pages, program.page_size, program.dtype)
    free, _ = torch.cuda.mem_get_info(device)
    # activations (they grow with the prefill unit), sampling and graph pools: 2 GiB per 2048-token unit;
    # the vision tower's: about 32 KiB per patch (4 patches per image token) at its widest layer
    chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
    headroom = 2 * 2**30 * max(1, -(-chunk // 2048)) + program.max_image_tokens * 4 * 32 * 2**10
    if need + headroom > free:
        gib = 2**30
        raise ValueError(
            f"the KV pool for max_context={max_context} x max_concurrency={config.max_concurrency} needs "
            f"{need / gib:.1f} GiB (+{headroom / gib:.0f} GiB working space for {chunk}-token prefill "
            f"units) but {free / gib:.1f} GiB is free after the weights; lower --max-context or "
            "--max-concurrency"
        )
