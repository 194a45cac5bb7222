"""Where the vision tower's time goes on the GPU: its kernels, grouped, for one image.

    python3 -m tools.vision_profile [PACKAGE] [--size 1024] [--repeats 3] [--reference]

Random bf16 weights of the package's vision tower alone (its exact dims, not the text model), one
SIZE x SIZE still image's grid (patch 16, the temporal pair), `vision_embeddings` warm, then timed with
CUDA events (median) and under `torch.profiler`: each kernel's device time per call, the top ones, and
the total per class (GEMM, attention, elementwise, norm, copy), beside the tower's FLOPs (matmuls and
attention) and the measured bf16 matmul rate.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch

from ninfer.bench.probes import measure_matmul_flops, median_seconds
from ninfer.targets.qwen3_6.kernels import REFERENCE, fast_kernels
from ninfer.targets.qwen3_6.variant import VisionDims
from ninfer.targets.qwen3_6.view import VisionBlockView, VisionMergerView, VisionView
from ninfer.targets.qwen3_6.vision import vision_embeddings
from ninfer.targets.registry import get_package


def random_vision_view(dims: VisionDims, device: torch.device, dtype: torch.dtype) -> VisionView:
    gen = torch.Generator(device=device).manual_seed(0)
    c, m = dims.hidden_size, dims.intermediate_size

    def w(*shape: int, scale: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * scale).to(dtype)

    def block() -> VisionBlockView:
        return VisionBlockView(
            norm1_weight=w(c, scale=1.0), norm1_bias=w(c), norm2_weight=w(c, scale=1.0), norm2_bias=w(c),
            qkv_weight=w(3 * c, c), qkv_bias=w(3 * c), proj_weight=w(c, c), proj_bias=w(c),
            fc1_weight=w(m, c), fc1_bias=w(m), fc2_weight=w(c, m), fc2_bias=w(c),
        )  # fmt: skip

    merged = c * dims.spatial_merge_size**2
    return VisionView(
        patch_embed_weight=w(c, dims.in_channels, dims.temporal_patch_size, dims.patch_size, dims.patch_size),
        patch_embed_bias=w(c),
        pos_embed=w(dims.num_position_embeddings, c),
        blocks=tuple(block() for _ in range(dims.depth)),
        merger=VisionMergerView(
            norm_weight=w(c, scale=1.0), norm_bias=w(c), fc1_weight=w(merged, merged), fc1_bias=w(merged),
            fc2_weight=w(dims.out_hidden_size, merged), fc2_bias=w(dims.out_hidden_size),
        ),
    )  # fmt: skip


def kernel_class(name: str) -> str:
    low = name.lower()
    if any(k in low for k in ("gemm", "cutlass", "sm90_xmma", "nvjet", "matmul", "cublas")):
        return "gemm"
    if any(k in low for k in ("flash", "fmha", "attention", "efficient")):
        return "attention"
    if "norm" in low:
        return "norm"
    if any(k in low for k in ("copy", "cat", "index")):
        return "copy/cat/index"
    return "elementwise/other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="qwen3_6_27b")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference", dest="fast", action="store_false", help="the reference table's rotary")
    args = parser.parse_args()
    dims = get_package(args.package).variant.vision
    assert dims is not None, f"{args.package} has no vision tower"
    device = torch.device("cuda")
    view = random_vision_view(dims, device, torch.bfloat16)
    side = args.size // dims.patch_size
    grid = (1, side, side)
    width = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
    pixels = torch.randn(side * side, width, device=device)
    n, c, m = side * side, dims.hidden_size, dims.intermediate_size
    flops = dims.depth * (2 * n * (4 * c * c + 2 * c * m) + 4 * n * n * c)
    merged = c * dims.spatial_merge_size**2
    merged_rows = n // dims.spatial_merge_size**2
    flops += 2 * n * width * c + 2 * merged_rows * merged * (merged + dims.out_hidden_size)

    kernels = fast_kernels() if args.fast else REFERENCE

    def tower() -> torch.Tensor:
        with torch.inference_mode():
            return vision_embeddings(view, dims, pixels, [grid], kernels)

    ms = 1e3 * median_seconds(tower, device, 5, warmup=3)
    peak, _ = measure_matmul_flops(device, torch.bfloat16)
    print(
        f"{args.package} vision tower, {args.size}x{args.size}: {n} patches, {ms:.2f} ms (median of 5), "
        f"{flops / 1e12:.2f} TFLOP, {flops / ms / 1e9:.0f} TFLOP/s = {100 * flops / (ms / 1e3) / peak:.1f} % "
        f"of the measured bf16 matmul rate {peak / 1e12:.0f} TFLOP/s"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(args.repeats):
            tower()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    count: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:110]] += event.device_time / args.repeats / 1e3
            count[event.name[:110]] += 1 / args.repeats
    per_class: dict[str, float] = defaultdict(float)
    for name, t in per_kernel.items():
        per_class[kernel_class(name)] += t
    print(f"kernels: {sum(per_kernel.values()):.2f} ms a call, {sum(count.values()):.0f} launches")
    for name, t in sorted(per_class.items(), key=lambda kv: -kv[1]):
        print(f"  {name:20s} {t:7.2f} ms")
    for name, t in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]:
        print(f"  {t:7.3f} ms  x{count[name]:5.0f}  {name}")


if __name__ == "__main__":
    main()
