"""What every kernel timing script shares: the timer, the error measure, CUDA-graph replay, and the
closing check line plus the JSON written under $OUT."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import triton.testing

BF16_BOUND = 1e-2  # max relative error a bf16 kernel may show against its reference


def time_us(fn: Callable[[], object]) -> float:
    """Median time of ``fn`` in microseconds (CUDA events, after warm-up)."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """fn captured once in a CUDA graph (after a warm-up run that compiles it); returns the replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timing_row(
    op: str,
    variant: str,
    shape: tuple[int, ...],
    nbytes: int,
    fast_us: float,
    ref_us: float,
    error: float,
    ref_label: str = "torch",
) -> dict[str, object]:
    """One kernel-vs-reference line (printed) and its JSON row: times, bytes, GB/s, speed-up, error."""
    row = {
        "op": op,
        "variant": variant,
        "shape": list(shape),
        "triton_us": round(fast_us, 2),
        "bytes": nbytes,
        "GB/s": round(nbytes / fast_us / 1e3, 1),
        "torch_us": round(ref_us, 2),
        "speedup": round(ref_us / fast_us, 2),
        "max_rel_err": error,
    }
    print(
        f"{op:>22} {variant:>8} {str(tuple(shape)):>18}  triton {fast_us:8.2f} us  {nbytes / 1e6:9.3f} MB "
        f"{row['GB/s']:8.1f} GB/s  {ref_label} {ref_us:8.2f} us  x{row['speedup']:<6} err {error:.2e}",
        flush=True,
    )
    return row


def finish(name: str, rows: list[dict[str, object]], bound: float = BF16_BOUND) -> bool:
    """Print the check line (worst error of ``rows`` against ``bound``) and write $OUT/<name>.json."""
    worst = max(rows, key=lambda row: float(row["max_rel_err"]))  # type: ignore[arg-type]
    passed = float(worst["max_rel_err"]) < bound  # type: ignore[arg-type]
    where = " ".join(str(worst[k]) for k in ("op", "variant", "shape", "tokens", "name") if k in worst)
    print(
        f"check: {'PASS' if passed else 'FAIL'} (worst {where}: {float(worst['max_rel_err']):.2e}, "  # type: ignore[arg-type]
        f"bound {bound:.0e})",
        flush=True,
    )
    if out_dir := os.environ.get("OUT"):
        with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
            summary = {"rows": rows, "worst_max_rel_err": worst["max_rel_err"], "passed": passed}
            json.dump(summary, f, indent=1)
    return passed
