"""`run_bench`: probe the device, start the Engine, drive it, and set every figure beside its roofline."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import UTC, datetime

import torch

from ninfer.bench.drive import BenchPlan, EngineDriver, Measurements, PromptSource, measure
from ninfer.bench.probes import DeviceProbe, probe_device
from ninfer.bench.report import BenchReport, DecodeRow, LatencyRow, PrefillRow, RunHeader, git_commit
from ninfer.bench.roofline import DECODE_ASSUMPTIONS, MOE_ASSUMPTION, decode_step_bytes, prefill_flops
from ninfer.bench.startup import SYNTHETIC_STORAGE, StartedEngine, start_from_artifact, start_synthetic
from ninfer.targets.open import (
    artifact_package,
    resolve_device,
    resolve_dtype,
    resolve_kernels,
    resolve_lookahead,
)
from ninfer.targets.package import Package
from ninfer.targets.qwen3_6.variant import SpecialTokens, Variant
from ninfer.targets.registry import get_package
from ninfer.types import EngineConfig, parse_speculative

TIMING_NOTES = (
    "decode ms/step: median gap between consecutive decode rounds of all B rows, from an EngineCore "
    "observer (worker bookkeeping between rounds included)",
    "prefill ms: worker time from the first prompt chunk to the next unit; TTFT: submit to first token "
    "delta; TPOT: (last - first token delta) / (tokens - 1) of that request, at the caller",
)


@dataclass(frozen=True)
class BenchOptions:
    plan: BenchPlan
    artifact: str | None = None  # a .ninfer file, or None with ``synthetic``
    synthetic: str | None = None  # package name: random weights of its exact dims
    device: str = "auto"
    dtype: str = "auto"
    cuda_graphs: bool = True
    decode_lookahead: bool | None = None  # EngineConfig.decode_lookahead
    kernels: str = "auto"  # EngineConfig.kernels
    speculative: str | None = None  # EngineConfig.speculative
    seed: int = 0  # random weights (synthetic) and prompt ids
    copy_bytes: int | None = None  # probe sizes (None: the device's default)
    matmul_n: int | None = None
    probe_repeats: int = 10
    prefix_cache: bool = False  # EngineConfig.prefix_cache (the standard suite: off, cold prompts)
    cache_memory_gb: float | None = None  # EngineConfig.cache_memory_gb
    host_cache_gb: float = 0.0  # EngineConfig.host_cache_gb
    gpu_memory_fraction: float | None = None  # EngineConfig.gpu_memory_fraction (None: its default)

    def __post_init__(self) -> None:
        if (self.artifact is None) == (self.synthetic is None):
            raise ValueError("give exactly one of an artifact or a synthetic package")


def first_special_id(special: SpecialTokens) -> int:
    """Ids below this are ordinary text tokens (every package puts its special tokens at the end)."""
    ids: list[int] = []
    for f in fields(special):
        value = getattr(special, f.name)
        ids.extend(value if isinstance(value, tuple) else (value,))
    return min(ids)


def engine_config(options: BenchOptions) -> EngineConfig:
    plan = options.plan
    concurrency = max(plan.batches)
    return EngineConfig(
        max_concurrency=concurrency,
        queue_capacity=concurrency,
        queue_timeout_s=None,
        max_context=plan.max_context,
        device=options.device,  # type: ignore[arg-type]
        dtype=options.dtype,  # type: ignore[arg-type]
        prefill_chunk_tokens=plan.prefill_chunk,
        cuda_graphs=options.cuda_graphs,
        decode_lookahead=options.decode_lookahead,
        kernels=options.kernels,  # type: ignore[arg-type]
        speculative=options.speculative,
        warmup=True,
        # the decode and prefill figures are of cold prompts either way (every prompt is distinct random
        # ids); the cache on adds its lookups and the captures inside long prompts (capture_interval)
        prefix_cache=options.prefix_cache,
        cache_memory_gb=options.cache_memory_gb if options.prefix_cache else None,
        host_cache_gb=options.host_cache_gb if options.prefix_cache else 0.0,
        **({"gpu_memory_fraction": options.gpu_memory_fraction} if options.gpu_memory_fraction else {}),
    )


def check_fits(plan: BenchPlan, variant: Variant) -> None:
    limit = variant.max_position_embeddings
    if plan.max_context > limit:
        raise ValueError(
            f"the bench needs {plan.max_context} positions per request (context {plan.context} + decode "
            f"budget {plan.decode_max_tokens(max(plan.batches))}, or prefill {plan.prefill_tokens} + "
            f"{plan.decode_steps + 1} tokens) but the model holds {limit}; lower --context, --prefill-tokens "
            "or --decode-steps"
        )


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine() or 'unknown'}, {torch.get_num_threads()} threads)"


def options_package(options: BenchOptions) -> tuple[Package, torch.dtype]:
    """The package under test and its storage dtype (synthetic weights: `SYNTHETIC_STORAGE`)."""
    if options.synthetic is not None:
        return get_package(options.synthetic), SYNTHETIC_STORAGE
    assert options.artifact is not None
    return artifact_package(options.artifact)


def probe_and_start(
    options: BenchOptions, config: EngineConfig, log: Callable[[str], None]
) -> tuple[DeviceProbe, StartedEngine]:
    """The device probes (before the model takes the memory), then the Engine under test."""
    package, storage = options_package(options)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, storage, device)
    log(f"probing {device.type} memory bandwidth and {str(dtype).removeprefix('torch.')} matmul throughput")
    probe = probe_device(
        device, dtype, copy_bytes=options.copy_bytes, matmul_n=options.matmul_n, repeats=options.probe_repeats
    )
    log("starting the Engine" + (f" with synthetic {package.name} weights" if options.synthetic else ""))
    started = (
        start_synthetic(package.name, config, seed=options.seed)
        if options.synthetic is not None
        else start_from_artifact(options.artifact or "", config)
    )
    return probe, started


def run_header(started: StartedEngine, probe: DeviceProbe) -> RunHeader:
    return RunHeader(
        package=started.package.name,
        synthetic=started.synthetic,
        artifact=started.artifact,
        device=describe_device(started.device),
        dtype=str(started.dtype).removeprefix("torch."),
        torch_version=torch.__version__,
        commit=git_commit(),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        bandwidth_GBps=probe.bandwidth_bytes_per_s / 1e9,
        copy_bytes=probe.copy_bytes,
        matmul_TFLOPs=probe.matmul_flops_per_s / 1e12,
        matmul_n=probe.matmul_n,
        matmul_dtype=str(probe.matmul_dtype).removeprefix("torch."),
        startup_s=dict(started.phases_s, total=started.startup_s),
        load=started.load,
    )


def run_bench(options: BenchOptions, log: Callable[[str], None] = lambda _: None) -> BenchReport:
    plan = options.plan
    package, _ = options_package(options)
    check_fits(plan, package.variant)
    probe, started = probe_and_start(options, engine_config(options), log)
    try:
        prompts = PromptSource(first_special_id(package.variant.special), options.seed)
        measurements = measure(EngineDriver(started.engine, plan, prompts), log)
    finally:
        started.engine.close()
    return build_report(options, started, probe, measurements)


def build_report(
    options: BenchOptions, started: StartedEngine, probe: DeviceProbe, m: Measurements
) -> BenchReport:
    plan, variant, dtype = options.plan, started.package.variant, started.dtype
    bandwidth = probe.bandwidth_bytes_per_s
    spec = parse_speculative(options.speculative)
    # the known backend's rows produce exactly its scripted mean per round; plain decoding one token
    per_round = spec.mean_accepted if spec is not None and spec.mean_accepted is not None else 1.0
    decode = []
    for sample in m.decode:
        bytes_step = decode_step_bytes(variant, sample.batch, plan.context, dtype).total
        decode.append(
            DecodeRow(
                batch=sample.batch,
                context=plan.context,
                steps=len(sample.step_s),
                ms_step=sample.median_s * 1e3,
                ms_step_min=min(sample.step_s) * 1e3,
                ms_step_max=max(sample.step_s) * 1e3,
                floor_ms=bytes_step / bandwidth * 1e3,
                bytes_step=bytes_step,
                tokens_per_round=per_round,
            )
        )
    flops = prefill_flops(variant, plan.prefill_tokens).total
    prefill_floor_ms = flops / probe.matmul_flops_per_s * 1e3
    tpot_bytes = decode_step_bytes(variant, 1, plan.prefill_tokens, dtype).total
    phases = dict(started.phases_s, total=started.startup_s)
    assumptions = DECODE_ASSUMPTIONS + ((MOE_ASSUMPTION,) if variant.moe else ()) + TIMING_NOTES
    if spec is not None:
        assumptions += (
            f"decode ran speculative {options.speculative}: a round is one verify of {spec.draft_tokens} "
            f"drafts per row (B x {spec.draft_tokens + 1} tokens); tok/s counts {per_round:g} tokens per row "
            "per round"
            + (
                " (the known backend's scripted acceptance: its output is not the model's)"
                if spec.method == "known"
                else ""
            ),
        )
    return BenchReport(
        package=started.package.name,
        synthetic=started.synthetic,
        artifact=started.artifact,
        device=describe_device(started.device),
        dtype=str(dtype).removeprefix("torch."),
        torch_version=torch.__version__,
        commit=git_commit(),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        bandwidth_GBps=bandwidth / 1e9,
        copy_bytes=probe.copy_bytes,
        matmul_TFLOPs=probe.matmul_flops_per_s / 1e12,
        matmul_n=probe.matmul_n,
        matmul_dtype=str(probe.matmul_dtype).removeprefix("torch."),
        startup_s=phases,
        load=started.load,
        decode=tuple(decode),
        prefill=PrefillRow(
            tokens=plan.prefill_tokens,
            repeats=len(m.prefill),
            chunk=plan.prefill_chunk,
            ms=statistics.median(s.prefill_s for s in m.prefill) * 1e3,
            floor_ms=prefill_floor_ms,
            flops=flops,
        ),
        ttft=LatencyRow(statistics.median(s.ttft_s for s in m.prefill) * 1e3, prefill_floor_ms),
        tpot=LatencyRow(statistics.median(s.tpot_s for s in m.prefill) * 1e3, tpot_bytes / bandwidth * 1e3),
        settings={
            "batches": sorted(set(plan.batches)),
            "context": plan.context,
            "decode_steps": plan.decode_steps,
            "prefill_tokens": plan.prefill_tokens,
            "prefill_repeats": plan.prefill_repeats,
            "prefill_chunk": plan.prefill_chunk,
            "max_context": plan.max_context,
            "cuda_graphs": options.cuda_graphs and started.device.type == "cuda",
            "decode_lookahead": resolve_lookahead(options.decode_lookahead, started.device),
            "kernels": resolve_kernels(started.device, options.kernels),
            "speculative": options.speculative,
            "prefix_cache": options.prefix_cache,
            "seed": options.seed,
        },
        assumptions=assumptions,
    )
