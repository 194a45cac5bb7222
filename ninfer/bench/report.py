"""The bench result: one value, rendered as a readable table or as one JSON object."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SYNTHETIC_NOTE = "synthetic weights: output text is meaningless"


@dataclass(frozen=True)
class DecodeRow:
    batch: int
    context: int
    steps: int  # timed rounds of all B rows
    ms_step: float  # median
    ms_step_min: float
    ms_step_max: float
    floor_ms: float  # bytes_step over the measured bandwidth
    bytes_step: int
    tokens_per_round: float = 1.0  # mean tokens a row produces per round (speculative decoding: > 1)
    kv_bytes: int = 0  # of bytes_step: K and V of the B rows' positions
    state_bytes: int = 0  # of bytes_step: the B rows' GDN state (read; the long-context floor: and written)
    # the long-context decode (shared prompts): each row's prompt, the checkpoint's frontier, what each
    # row reused (empty for cold rows)
    prompt_tokens: int = 0
    frontier: int = 0
    reused_tokens: tuple[int, ...] = ()

    @property
    def shared(self) -> bool:
        return bool(self.reused_tokens)

    @property
    def reused(self) -> bool:
        """Every row continued the shared prompt's checkpoint (long-context decode)."""
        return self.shared and self.frontier > 0 and all(r == self.frontier for r in self.reused_tokens)

    @property
    def tok_s(self) -> float:
        return self.batch * self.tokens_per_round * 1e3 / self.ms_step

    @property
    def floor_tok_s(self) -> float:
        return self.batch * 1e3 / self.floor_ms

    @property
    def pct_floor(self) -> float:
        """Floor time as a percentage of the measured time (100 = at the roofline)."""
        return 100.0 * self.floor_ms / self.ms_step


@dataclass(frozen=True)
class PrefillRow:
    tokens: int
    repeats: int
    chunk: int  # prompt tokens per prefill unit
    ms: float  # median worker time of the whole prompt
    floor_ms: float  # flops over the measured matmul throughput
    flops: int
    flops_linear: int = 0  # of flops: the matrix products (`roofline.PrefillFlops`)
    flops_attention: int = 0  # of flops: causal attention, every full-attention layer
    flops_recurrence: int = 0  # of flops: the GDN recurrence
    output_tokens: int = 0  # of each prefill request (TPOT is timed over them)

    @property
    def tok_s(self) -> float:
        return self.tokens * 1e3 / self.ms

    @property
    def pct_floor(self) -> float:
        return 100.0 * self.floor_ms / self.ms


@dataclass(frozen=True)
class LatencyRow:
    """A caller-side latency (TTFT or TPOT) beside its floor."""

    ms: float  # median over the prefill repeats
    floor_ms: float

    @property
    def pct_floor(self) -> float:
        return 100.0 * self.floor_ms / self.ms


@dataclass(frozen=True)
class BenchReport:
    package: str
    synthetic: bool
    artifact: str | None
    device: str
    dtype: str
    torch_version: str
    commit: str | None
    date: str  # ISO 8601, UTC
    bandwidth_GBps: float  # named as its JSON field
    copy_bytes: int
    matmul_TFLOPs: float
    matmul_n: int
    matmul_dtype: str
    startup_s: dict[str, float]  # phase -> seconds; "total" last
    load: Any  # the weight loader's LoadReport (artifacts only): prose in the table, numbers in JSON
    decode: tuple[DecodeRow, ...]
    prefill: PrefillRow
    ttft: LatencyRow
    tpot: LatencyRow  # one stream at B=1 after the prefill prompt; floor at that context
    settings: dict[str, Any]
    assumptions: tuple[str, ...]
    skipped: tuple[Any, ...] = ()  # drive.Skipped: the long-context (N, B) not run, with the reason

    def to_json(self) -> dict[str, Any]:
        out = header_json(self)
        out.update(
            decode=[
                {
                    "batch": r.batch,
                    "context": r.context,
                    "steps": r.steps,
                    "ms_step": round(r.ms_step, 4),
                    "ms_step_min": round(r.ms_step_min, 4),
                    "ms_step_max": round(r.ms_step_max, 4),
                    "tok_s": round(r.tok_s, 2),
                    "tokens_per_round": round(r.tokens_per_round, 3),
                    "floor_ms": round(r.floor_ms, 4),
                    "floor_tok_s": round(r.floor_tok_s, 2),
                    "pct_floor": round(r.pct_floor, 2),
                    "bytes_step": r.bytes_step,
                    "kv_bytes_step": r.kv_bytes,
                    "kv_GB_step": round(r.kv_bytes / 1e9, 4),
                    "state_bytes_step": r.state_bytes,
                    **(
                        {
                            "prompt_tokens": r.prompt_tokens,
                            "frontier": r.frontier,
                            "reused_prefix_tokens": list(r.reused_tokens),
                            "reused": r.reused,
                        }
                        if r.shared
                        else {}
                    ),
                }
                for r in self.decode
            ],
            decode_skipped=[
                {"context": k.context, "batch": k.batch, "reason": k.reason} for k in self.skipped
            ],
            prefill={
                "tokens": self.prefill.tokens,
                "repeats": self.prefill.repeats,
                "chunk": self.prefill.chunk,
                "ms": round(self.prefill.ms, 3),
                "tok_s": round(self.prefill.tok_s, 1),
                "floor_ms": round(self.prefill.floor_ms, 4),
                "pct_floor": round(self.prefill.pct_floor, 2),
                "flops": self.prefill.flops,
                "flops_linear": self.prefill.flops_linear,
                "flops_attention": self.prefill.flops_attention,
                "flops_recurrence": self.prefill.flops_recurrence,
                "output_tokens": self.prefill.output_tokens,
            },
            ttft_ms=round(self.ttft.ms, 3),
            ttft_floor_ms=round(self.ttft.floor_ms, 4),
            ttft_pct_floor=round(self.ttft.pct_floor, 2),
            tpot_ms=round(self.tpot.ms, 4),
            tpot_floor_ms=round(self.tpot.floor_ms, 4),
            tpot_pct_floor=round(self.tpot.pct_floor, 2),
            settings=self.settings,
            assumptions=list(self.assumptions),
        )
        return out


@dataclass(frozen=True)
class RunHeader:
    """What every bench mode reports first: the package, the device and its probes, the start-up."""

    package: str
    synthetic: bool
    artifact: str | None
    device: str
    dtype: str
    torch_version: str
    commit: str | None
    date: str  # ISO 8601, UTC
    bandwidth_GBps: float
    copy_bytes: int
    matmul_TFLOPs: float
    matmul_n: int
    matmul_dtype: str
    startup_s: dict[str, float]  # phase -> seconds; "total" last
    load: Any  # LoadReport | None

    def to_json(self) -> dict[str, Any]:
        return header_json(self)

    def lines(self, mode: str) -> list[str]:
        """The table's opening lines, ``mode`` naming the run (``--multi-turn``, ``--image``)."""
        out = [
            f"ninfer bench {mode}: {self.package} on {self.device}, {self.dtype}, "
            f"torch {self.torch_version}, commit {self.commit or 'unknown'}, {self.date}",
            f"*** {SYNTHETIC_NOTE} ***" if self.synthetic else f"artifact: {self.artifact}",
        ]
        phases = ", ".join(
            f"{k.replace('_', ' ')} {v:.2f} s" for k, v in self.startup_s.items() if k != "total"
        )
        out += [
            f"measured: copy bandwidth {self.bandwidth_GBps:.1f} GB/s; "
            f"matmul {self.matmul_TFLOPs:.3g} TFLOP/s ({self.matmul_dtype} {self.matmul_n}^3)",
            f"start-up: {self.startup_s['total']:.2f} s ({phases})"
            + (f"; weights: {self.load}" if self.load else ""),
        ]
        return out


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def render_table(report: BenchReport) -> str:
    """The human-readable report (the same figures as `BenchReport.to_json`)."""
    s = report.settings
    lines = [
        f"ninfer bench: {report.package} on {report.device}, {report.dtype}, torch {report.torch_version}, "
        f"commit {report.commit or 'unknown'}, {report.date}",
    ]
    if report.synthetic:
        lines.append(f"*** {SYNTHETIC_NOTE} ***")
    else:
        lines.append(f"artifact: {report.artifact}")
    phases = ", ".join(
        f"{k.replace('_', ' ')} {v:.2f} s" for k, v in report.startup_s.items() if k != "total"
    )
    lines += [
        f"kernels: {s.get('kernels', 'auto')}; cuda graphs: {'on' if s.get('cuda_graphs') else 'off'}; "
        f"decode lookahead: {'on' if s.get('decode_lookahead') else 'off'}",
        f"measured: copy bandwidth {report.bandwidth_GBps:.1f} GB/s; "
        f"matmul {report.matmul_TFLOPs:.3g} TFLOP/s ({report.matmul_dtype} {report.matmul_n}^3)",
        f"start-up: {report.startup_s['total']:.2f} s ({phases})"
        + (f"; weights: {report.load}" if report.load else ""),
        "",
        *(_long_context_lines(report) if "contexts" in s else _decode_lines(report)),
    ]
    p, ttft, tpot = report.prefill, report.ttft, report.tpot
    lines += [
        "",
        f"prefill {p.tokens} tokens in chunks of {p.chunk} (median of {p.repeats}): {_ms(p.ms)} ms, "
        f"{p.tok_s:.0f} tok/s; floor {_ms(p.floor_ms)} ms ({p.flops / 1e12:.3g} TFLOP, attention "
        f"{100 * p.flops_attention / p.flops:.0f}%), {p.pct_floor:.1f}% of floor",
        f"TTFT {_ms(ttft.ms)} ms (floor {_ms(ttft.floor_ms)} ms, {ttft.pct_floor:.1f}%); "
        f"TPOT {_ms(tpot.ms)} ms at B=1, context {p.tokens} (floor {_ms(tpot.floor_ms)} ms, "
        f"{tpot.pct_floor:.1f}%)",
        "",
        *(f"note: {a}" for a in report.assumptions),
    ]
    return "\n".join(lines)


def _decode_lines(report: BenchReport) -> list[str]:
    s = report.settings
    lines = [
        f"decode at context {s['context']} (median of {s['decode_steps']} rounds of all B rows)",
        f"{'B':>3} {'ms/step':>9} {'tok/s':>10} {'floor ms':>9} {'floor tok/s':>12} {'% of floor':>10} "
        f"{'GB/step':>8} {'min..max ms':>16}",
    ]
    for r in report.decode:
        spread = f"{_ms(r.ms_step_min)}..{_ms(r.ms_step_max)}"
        lines.append(
            f"{r.batch:>3} {_ms(r.ms_step):>9} {r.tok_s:>10.1f} {_ms(r.floor_ms):>9} {r.floor_tok_s:>12.1f} "
            f"{r.pct_floor:>9.1f}% {r.bytes_step / 1e9:>8.3f} {spread:>16}"
        )
    return lines


def _long_context_lines(report: BenchReport) -> list[str]:
    """The long-context decode: one line per (context, B) run, one per skipped."""
    s = report.settings
    lines = [
        f"long-context decode at {', '.join(str(n) for n in s['contexts'])} (each context's B rows share one "
        f"prefilled prompt through the context cache, capture interval {s['capture_interval']}; median of "
        f"{s['decode_steps']} rounds of all B rows); KV pool {s['kv_pool_tokens']:,} tokens "
        f"({s['kv_pool_bytes'] / 1e9:.1f} GB), max_context {s['engine_max_context']:,}",
        f"{'context':>8} {'prompt':>8} {'B':>3} {'ms/step':>9} {'tok/s':>9} {'floor ms':>9} "
        f"{'% of floor':>10} {'GB/step':>8} {'KV GB':>7} {'reused':>8}",
    ]
    for r in report.decode:
        reused = f"{min(r.reused_tokens)}" if r.reused else "NO"
        lines.append(
            f"{r.context:>8} {r.prompt_tokens:>8} {r.batch:>3} {_ms(r.ms_step):>9} {r.tok_s:>9.1f} "
            f"{_ms(r.floor_ms):>9} {r.pct_floor:>9.1f}% {r.bytes_step / 1e9:>8.3f} {r.kv_bytes / 1e9:>7.3f} "
            f"{reused:>8}"
        )
    lines += [f"context {k.context} B={k.batch} skipped: {k.reason}" for k in report.skipped]
    return lines


def git_commit() -> str | None:
    """The source tree's commit (``-dirty`` when tracked files differ from it), or None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return f"{commit}-dirty" if dirty.returncode == 1 else commit


def load_json(load: Any) -> dict[str, Any] | None:
    """The weight load's figures (``artifact.loader.LoadReport``) as numbers; GB are 10^9 bytes."""
    if load is None:
        return None
    return {
        "bytes": load.nbytes,
        "seconds": round(load.seconds, 4),
        "GBps": round(load.gb_per_s, 3),
        "tensors": load.num_tensors,
        "staging_fills": load.num_batches,
        "device": load.device,
        "zero_copy": load.zero_copy,
    }


def header_json(run: RunHeader | BenchReport) -> dict[str, Any]:
    """The leading fields every bench mode's JSON starts with, in this order and rounding."""
    out: dict[str, Any] = {"package": run.package, "synthetic": run.synthetic}
    if run.synthetic:
        out["note"] = SYNTHETIC_NOTE
    out.update(
        artifact=run.artifact,
        device=run.device,
        dtype=run.dtype,
        torch=run.torch_version,
        commit=run.commit,
        date=run.date,
        bandwidth_GBps=round(run.bandwidth_GBps, 3),
        copy_bytes=run.copy_bytes,
        matmul_TFLOPs=round(run.matmul_TFLOPs, 4),
        matmul_n=run.matmul_n,
        matmul_dtype=run.matmul_dtype,
        startup_s={k: round(v, 3) for k, v in run.startup_s.items()},
        load=load_json(run.load),
    )
    return out
