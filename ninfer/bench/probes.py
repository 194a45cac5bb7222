"""Device probes the roofline divides by, measured in the same run as the figures beside them.

- Memory bandwidth: a large copy between two buffers (device to device on CUDA, a tensor copy on CPU),
  counted as the bytes it moves (read + write) per second; this is the rate a bandwidth-bound decode
  step can at best stream its bytes at.
- Matmul throughput: an ``n x n x n`` matmul in the compute dtype (bf16 on CUDA, fp32 on CPU by
  default), 2 n^3 FLOPs per call.

Each probe warms up first, then reports the median of its repeats; CUDA timings use events.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# probe sizes: well beyond the last-level cache (H200 L2 is 60 MB), small enough to leave memory free
CUDA_COPY_BYTES = 1 << 30
CPU_COPY_BYTES = 1 << 26
CUDA_MATMUL_N = 8192
CPU_MATMUL_N = 1024


@dataclass(frozen=True)
class DeviceProbe:
    bandwidth_bytes_per_s: float  # read + write bytes per second of a large copy
    copy_bytes: int  # size of one buffer of the copy
    matmul_flops_per_s: float
    matmul_n: int
    matmul_dtype: torch.dtype


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup`` untimed ones (CUDA: events)."""
    return statistics.median(timed_seconds(fn, device, repeats, warmup))


def timed_seconds(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones (CUDA: events, each
    call synchronised)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    for _ in range(warmup):
        fn()
    times: list[float] = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def measure_copy_bandwidth(
    device: torch.device, nbytes: int | None = None, *, repeats: int = 10, warmup: int = 3
) -> tuple[float, int]:
    """(bytes moved per second, buffer size): median of ``repeats`` copies of ``nbytes`` bytes."""
    nbytes = nbytes or (CUDA_COPY_BYTES if device.type == "cuda" else CPU_COPY_BYTES)
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, repeats, warmup)
    return 2 * nbytes / seconds, nbytes


def measure_matmul_flops(
    device: torch.device, dtype: torch.dtype, n: int | None = None, *, repeats: int = 10, warmup: int = 3
) -> tuple[float, int]:
    """(FLOP/s, n): median of ``repeats`` ``n x n x n`` matmuls in ``dtype`` into a preallocated output."""
    n = n or (CUDA_MATMUL_N if device.type == "cuda" else CPU_MATMUL_N)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, generator=generator).to(dtype)
    b = torch.randn(n, n, device=device, generator=generator).to(dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: torch.matmul(a, b, out=out), device, repeats, warmup)
    return 2 * n**3 / seconds, n


def probe_device(
    device: torch.device,
    dtype: torch.dtype,
    *,
    copy_bytes: int | None = None,
    matmul_n: int | None = None,
    repeats: int = 10,
) -> DeviceProbe:
    """Both probes; on CUDA the probe buffers go back to the driver so the model has the memory."""
    bandwidth, nbytes = measure_copy_bandwidth(device, copy_bytes, repeats=repeats)
    flops, n = measure_matmul_flops(device, dtype, matmul_n, repeats=repeats)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return DeviceProbe(bandwidth, nbytes, flops, n, dtype)
