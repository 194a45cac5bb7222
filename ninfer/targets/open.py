"""Build a package's Program and Frontend from a `.ninfer` artifact and an `EngineConfig`.

This is the single seam between the model-free Engine and the targets: the Engine facade calls
`open_target` once, at construction, and from then on talks to the returned objects through the
runtime contracts only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ninfer.targets.qwen3_6.frontend import Frontend, FrontendResources
from ninfer.targets.qwen3_6.kernels import kernels_name
from ninfer.types import default_prefill_chunk

# Without an explicit max_context a Program holds this many positions per request (bounded so the
# default KV pool stays small; the model itself allows variant.max_position_embeddings).
DEFAULT_MAX_CONTEXT = 32768


@dataclass(frozen=True)
class OpenedTarget:
    program: Any  # Program (generation) or ScoringProgram (causal_scoring)
    frontend: Frontend
    package_name: str
    load_report: Any = None  # artifact.loader.LoadReport: bytes, seconds and GB/s of the weight load


def prefill_unit(requested: int | None, device: torch.device, kernels: str) -> int:
    """Prompt tokens per prefill unit: ``requested``, or the default of the op table ``kernels`` selects
    on ``device`` (what the Engine resolves from the Program it is given)."""
    return requested or default_prefill_chunk(kernels_name(device, kernels))


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


def load_frontend(artifact_path: str) -> Frontend:
    """The package's Frontend from the artifact's resources (no weights touched)."""
    from ninfer.artifact import Artifact, check_identity

    with Artifact.open(artifact_path) as artifact:
        package = check_identity(artifact)
        return _frontend(artifact, package.variant.special, package.variant.vision)


def _frontend(artifact: Any, special: Any, vision: Any = None) -> Frontend:
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
        special,
        vision,
    )


def open_target(artifact_path: str, config: Any) -> OpenedTarget:
    from ninfer.artifact import Artifact
    from ninfer.targets.qwen3_6.binder import load_model

    device = resolve_device(config.device)
    with Artifact.open(artifact_path) as artifact:
        storage = _storage_dtype(artifact)
    dtype = resolve_dtype(config.dtype, storage, device)
    loaded = load_model(artifact_path, device, dtype)
    package, view = loaded.package, loaded.view
    frontend = load_frontend(artifact_path)
    variant = package.variant
    if config.purpose == "causal_scoring":
        from ninfer.targets.qwen3_6.impl.runtime.scoring import Qwen36ScoringProgram

        program: Any = Qwen36ScoringProgram(
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
    variant: Any, view: Any, config: Any, max_context: int, device: torch.device, dtype: torch.dtype
) -> Any:
    """The generation Program for an EngineConfig: a KV pool that holds ``max_context`` positions for
    every lane, refused with the flags to change when the model or the device cannot hold it."""
    from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program

    if max_context > variant.max_position_embeddings:
        raise ValueError(
            f"max_context {max_context} exceeds the model's {variant.max_position_embeddings} positions"
        )
    pages_per_seq = -(-max_context // config.page_size)
    program_config = ProgramConfig(
        max_concurrency=config.max_concurrency,
        max_context=max_context,
        page_size=config.page_size,
        kv_pages=pages_per_seq * config.max_concurrency,
        device=device,
        dtype=dtype,
        cuda_graphs=config.cuda_graphs,
        kernels=config.kernels,
        decode_lookahead=resolve_lookahead(config.decode_lookahead, device),
    )
    _check_state_memory(variant, config, program_config, max_context)
    return Qwen36Program(variant, view, program_config)


def state_bytes(variant: Any, num_slots: int, num_pages: int, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of the Program's StateStore: GDN conv + fp32 recurrent slots, and K/V pages."""
    elem = torch.empty((), dtype=dtype).element_size()
    n_gdn, n_attn = len(variant.gdn_layers), len(variant.attention_layers)
    conv = n_gdn * num_slots * variant.conv_dim * (variant.linear_conv_kernel_dim - 1) * elem
    rec = n_gdn * num_slots * variant.linear_num_value_heads * variant.linear_key_head_dim
    rec *= variant.linear_value_head_dim * 4
    kv = 2 * n_attn * num_pages * page_size * variant.num_kv_heads * variant.head_dim * elem
    return conv + rec + kv


def _check_state_memory(variant: Any, config: Any, program: Any, max_context: int) -> None:
    """Refuse, with the flags to change, a KV pool that cannot fit next to the weights."""
    device = program.device
    if device.type != "cuda":
        return
    slots = program.slots_per_sequence * program.max_concurrency
    need = state_bytes(variant, slots, program.kv_pages, program.page_size, program.dtype)
    free, _ = torch.cuda.mem_get_info(device)
    # activations (they grow with the prefill unit), sampling and graph pools: 2 GiB per 2048-token unit
    chunk = prefill_unit(config.prefill_chunk_tokens, device, config.kernels)
    headroom = 2 * 2**30 * max(1, -(-chunk // 2048))
    if need + headroom > free:
        gib = 2**30
        raise ValueError(
            f"the KV pool for max_context={max_context} x max_concurrency={config.max_concurrency} needs "
            f"{need / gib:.1f} GiB (+{headroom / gib:.0f} GiB working space for {chunk}-token prefill "
            f"units) but {free / gib:.1f} GiB is free after the weights; lower --max-context or "
            "--max-concurrency"
        )


def _storage_dtype(artifact: Any) -> torch.dtype:
    from ninfer.targets.package import STORAGE_PROFILES

    return getattr(torch, STORAGE_PROFILES[artifact.identity["storage_profile"]])
