"""`run_bench`: probe the device, start the Engine, drive it, and set every figure beside its roofline."""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime

import torch

from ninfer.bench.context import LONG_CONTEXT_NOTES, LongContextPlan, SharedPromptDriver, measure_long_context
from ninfer.bench.drive import BenchPlan, EngineDriver, Measurements, PromptSource, measure
from ninfer.bench.probes import DeviceProbe, probe_device
from ninfer.bench.report import BenchReport, DecodeRow, LatencyRow, PrefillRow, RunHeader, git_commit
from ninfer.bench.roofline import DECODE_ASSUMPTIONS, MOE_ASSUMPTION, decode_step_bytes, prefill_flops
from ninfer.bench.startup import (
    SYNTHETIC_STORAGE,
    StartedEngine,
    restart,
    start_from_artifact,
    start_synthetic,
)
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
    prefill_graph_tokens: int = 1024  # EngineConfig.prefill_graph_tokens
    vision_graph_sizes: tuple[tuple[int, int], ...] = ()  # EngineConfig.vision_graph_sizes
    decode_lookahead: bool | None = None  # EngineConfig.decode_lookahead
    kernels: str = "auto"  # EngineConfig.kernels
    speculative: str | None = None  # EngineConfig.speculative
    draft_vocab: int | None = None  # EngineConfig.draft_vocab
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


def engine_config(options: BenchOptions, long_plan: LongContextPlan | None = None) -> EngineConfig:
    """The Engine under test. With ``long_plan`` (the long-context decode): the context cache on at the
    plan's capture interval; on CUDA without a max_context, so the pool fills the memory and the limit is
    the model's, or the most that fits (the (N, B) beyond it are skipped)."""
    plan = options.plan
    concurrency = max(plan.batches)
    if long_plan is not None:
        cuda = resolve_device(options.device).type == "cuda"
        return replace(
            engine_config(options),
            max_context=None if cuda else long_plan.max_context,
            prefix_cache=True,
            cache_memory_gb=options.cache_memory_gb,
            capture_interval=long_plan.interval,
        )
    return EngineConfig(
        max_concurrency=concurrency,
        queue_capacity=concurrency,
        queue_timeout_s=None,
        max_context=plan.max_context,
        device=options.device,  # type: ignore[arg-type]
        dtype=options.dtype,  # type: ignore[arg-type]
        prefill_chunk_tokens=plan.prefill_chunk,
        cuda_graphs=options.cuda_graphs,
        prefill_graph_tokens=options.prefill_graph_tokens,
        vision_graph_sizes=options.vision_graph_sizes,
        decode_lookahead=options.decode_lookahead,
        kernels=options.kernels,  # type: ignore[arg-type]
        speculative=options.speculative,
        draft_vocab=options.draft_vocab,
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
        decode = "" if plan.contexts else (
            f"context {plan.context} + decode budget {plan.decode_max_tokens(max(plan.batches))}, or "
        )  # fmt: skip
        raise ValueError(
            f"the bench needs {plan.max_context} positions per request ({decode}prefill "
            f"{plan.prefill_tokens} + {plan.prefill_max_tokens} tokens) but the model holds {limit}; lower "
            "--context, --prefill-tokens or --decode-steps"
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
    options: BenchOptions, config: EngineConfig, log: Callable[[str], None], *, drafter: bool = False
) -> tuple[DeviceProbe, StartedEngine]:
    """The device probes (before the model takes the memory), then the Engine under test; ``drafter``:
    synthetic weights include the package's DFlash drafter."""
    package, storage = options_package(options)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, storage, device)
    log(f"probing {device.type} memory bandwidth and {str(dtype).removeprefix('torch.')} matmul throughput")
    probe = probe_device(
        device, dtype, copy_bytes=options.copy_bytes, matmul_n=options.matmul_n, repeats=options.probe_repeats
    )
    log("starting the Engine" + (f" with synthetic {package.name} weights" if options.synthetic else ""))
    started = (
        start_synthetic(package.name, config, seed=options.seed, drafter=drafter)
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


def backend_options(options: BenchOptions, speculative: str | None) -> BenchOptions:
    """``options`` for one decode backend (None: plain decoding): the plan's budgets cover its most tokens
    a row a round (K + 1 for a verify), and only an MTP head takes the draft vocabulary."""
    spec = parse_speculative(speculative)
    plan = replace(options.plan, tokens_per_round=1 if spec is None else spec.draft_tokens + 1)
    draft_vocab = options.draft_vocab if spec is not None and spec.method == "mtp" else None
    return replace(options, plan=plan, speculative=speculative, draft_vocab=draft_vocab)


def run_bench(options: BenchOptions, log: Callable[[str], None] = lambda _: None) -> BenchReport:
    return run_bench_sweep(options, (options.speculative,), log)[0]


def run_bench_sweep(
    options: BenchOptions,
    backends: Sequence[str | None],
    log: Callable[[str], None] = lambda _: None,
    finished: Callable[[BenchReport], None] = lambda _: None,
) -> tuple[BenchReport, ...]:
    """The suite once per decode backend in ``backends`` (``EngineConfig.speculative``; None: plain
    decoding), over one set of weights: the device probes and the weights once, then an Engine per
    backend (`ninfer.bench.startup.restart`: the same weights and Frontend, a new Program). ``finished``
    gets each report as soon as it is made (a sweep cut short keeps what it measured)."""
    if not backends:
        raise ValueError("the sweep needs at least one decode backend")
    package, _ = options_package(options)
    runs = [backend_options(options, b) for b in backends]
    # synthetic weights hold the drafter only where a backend drafts with it (the 27B's is 3.5 GB)
    drafter = any(b is not None and b.startswith("dflash:") for b in backends)
    for run in runs:
        check_fits(run.plan, package.variant)
    positions = package.variant.max_position_embeddings
    prompts = PromptSource(first_special_id(package.variant.special), options.seed)
    reports: list[BenchReport] = []
    started: StartedEngine | None = None
    try:
        for run in runs:
            plan = run.plan
            long_plan = LongContextPlan.build(plan, positions) if plan.contexts else None
            config = engine_config(run, long_plan)
            if started is None:
                probe, started = probe_and_start(run, config, log, drafter=drafter)
            else:
                log(f"restarting the Engine with speculative={run.speculative}")
                started = restart(started, config)
            if long_plan is not None:
                log(started.engine.capacity().describe())
                driver = SharedPromptDriver(started.engine, plan, prompts)
                measurements = measure_long_context(driver, long_plan, log)
            else:
                measurements = measure(EngineDriver(started.engine, plan, prompts), log)
            reports.append(build_report(run, started, probe, measurements, long_plan))
            finished(reports[-1])
    finally:
        if started is not None and started.engine is not None:
            started.engine.close()
    return tuple(reports)


def build_report(
    options: BenchOptions,
    started: StartedEngine,
    probe: DeviceProbe,
    m: Measurements,
    long_plan: LongContextPlan | None = None,
) -> BenchReport:
    plan, variant, dtype = options.plan, started.package.variant, started.dtype
    bandwidth = probe.bandwidth_bytes_per_s
    spec = parse_speculative(options.speculative)
    # the known backend's rows produce exactly its scripted mean per round; plain decoding one token
    per_round = spec.mean_accepted if spec is not None and spec.mean_accepted is not None else 1.0
    decode = []
    capacity = m.capacity
    frontiers = {p.context: p.frontier for p in long_plan.prompts} if long_plan is not None else {}
    for sample in m.decode:
        shared = long_plan is not None
        # the long-context rows' floor is at their prompt positions, the GDN state read and written
        positions = sample.prompt_tokens if shared else plan.context
        step = decode_step_bytes(variant, sample.batch, positions, dtype, state_write=shared)
        decode.append(
            DecodeRow(
                batch=sample.batch,
                context=sample.context if shared else plan.context,
                steps=len(sample.step_s),
                ms_step=sample.median_s * 1e3,
                ms_step_min=min(sample.step_s) * 1e3,
                ms_step_max=max(sample.step_s) * 1e3,
                floor_ms=step.total / bandwidth * 1e3,
                bytes_step=step.total,
                tokens_per_round=per_round,
                kv_bytes=step.kv,
                state_bytes=step.state + step.state_write,
                prompt_tokens=positions,
                frontier=frontiers.get(sample.context, 0),
                reused_tokens=sample.reused_tokens,
            )
        )
    prefill_count = prefill_flops(variant, plan.prefill_tokens)
    flops = prefill_count.total
    prefill_floor_ms = flops / probe.matmul_flops_per_s * 1e3
    tpot_bytes = decode_step_bytes(variant, 1, plan.prefill_tokens, dtype).total
    phases = dict(started.phases_s, total=started.startup_s)
    # the long-context floor counts the state write-back: its note replaces the first decode one
    decode_notes = DECODE_ASSUMPTIONS if long_plan is None else LONG_CONTEXT_NOTES + DECODE_ASSUMPTIONS[1:]
    assumptions = decode_notes + ((MOE_ASSUMPTION,) if variant.moe else ()) + TIMING_NOTES
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
            flops_linear=prefill_count.linear,
            flops_attention=prefill_count.attention,
            flops_recurrence=prefill_count.recurrence,
            output_tokens=plan.prefill_max_tokens,
        ),
        ttft=LatencyRow(statistics.median(s.ttft_s for s in m.prefill) * 1e3, prefill_floor_ms),
        tpot=LatencyRow(statistics.median(s.tpot_s for s in m.prefill) * 1e3, tpot_bytes / bandwidth * 1e3),
        skipped=tuple(m.skipped),
        settings={
            "batches": sorted(set(plan.batches)),
            "context": plan.context,
            **(
                {
                    "contexts": [p.context for p in long_plan.prompts],
                    "capture_interval": long_plan.interval,
                    "shared_prompts": True,
                    "kv_pool_tokens": capacity.kv_pool_tokens,
                    "kv_pool_bytes": capacity.kv_pool_bytes,
                    "engine_max_context": capacity.max_context,
                }
                if long_plan is not None and capacity is not None
                else {}
            ),
            "decode_steps": plan.decode_steps,
            "prefill_tokens": plan.prefill_tokens,
            "prefill_repeats": plan.prefill_repeats,
            "prefill_chunk": plan.prefill_chunk,
            "max_context": plan.max_context,
            "cuda_graphs": options.cuda_graphs and started.device.type == "cuda",
            "prefill_graph_tokens": options.prefill_graph_tokens,
            "decode_lookahead": resolve_lookahead(options.decode_lookahead, started.device),
            "kernels": resolve_kernels(started.device, options.kernels),
            "speculative": options.speculative,
            "draft_vocab": options.draft_vocab,
            "prefix_cache": options.prefix_cache or long_plan is not None,
            "seed": options.seed,
        },
        assumptions=assumptions,
    )
