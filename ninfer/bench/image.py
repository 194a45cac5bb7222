"""`ninfer bench --image WxH[,WxH...]`: the vision tower and one-image prompts beside the tower's FLOP floor.

For each size, a random RGB image of that size (a `DecodedImage`, as the gateways hand images to the
Frontend) in a one-message chat, prepared by the Engine's Frontend (resize to the processor's grid,
normalise, patchify). Three figures:

- **tower**: `ninfer.targets.qwen3_6.vision.vision_embeddings` over that image's ``pixel_values`` (already
  on the device) with the Program's own vision weights: the call the Program makes before the prefill
  chunk that first needs the image (`impl/runtime/images.py`), timed alone, warm, median of the repeats;
  CUDA events, each call synchronised;
- **TTFT** of the one-image chat request through the public Engine (submit -> first token: the
  Frontend's preprocessing on the caller, the tower, the prefill), and beside it the TTFT of a token-id
  prompt of the same token count (no image): their difference is what the image costs in place;
- the tower's **FLOP floor** (`roofline.vision_flops` over the measured matmul throughput) and the
  achieved fraction of it.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ninfer.bench.drive import BenchError, BenchPlan, PromptSource, TimedDriver
from ninfer.bench.probes import timed_seconds
from ninfer.bench.report import RunHeader
from ninfer.bench.roofline import VISION_ASSUMPTION, VisionFlops, prefill_flops, vision_flops
from ninfer.bench.runner import (
    BenchOptions,
    engine_config,
    first_special_id,
    options_package,
    probe_and_start,
    run_header,
)
from ninfer.bench.startup import sizing_frontend
from ninfer.media.decode.image import DecodedImage
from ninfer.targets.open import resolve_kernels
from ninfer.types import GenerationRequest

MAX_SIDE = 8192  # DecodeLimits' default: larger images are refused before decoding
PROMPT_TEXT = "Describe this image."
REPLY_TOKENS = 2  # a decode unit after the prefill closes its span on the worker's clock


def random_image(width: int, height: int, seed: int) -> DecodedImage:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return DecodedImage(pixels)


def image_messages(image: DecodedImage) -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": PROMPT_TEXT}],
        }
    ]


@dataclass(frozen=True)
class ImageRow:
    width: int
    height: int
    grid_thw: tuple[int, int, int]  # patches after the processor's resize
    image_tokens: int
    prompt_tokens: int
    repeats: int
    tower_ms: tuple[float, ...]
    flops: VisionFlops
    tower_floor_ms: float
    ttft_image_ms: tuple[float, ...]
    submit_image_ms: tuple[float, ...]  # the submit call: preprocessing and tokenizing on the caller
    prefill_image_ms: tuple[float, ...]  # worker: the prefill units (the tower runs inside the first)
    ttft_text_ms: tuple[float, ...]
    prefill_text_ms: tuple[float, ...]
    ttft_floor_ms: float  # (prefill FLOPs of the prompt + the tower's) over the matmul throughput

    @property
    def tower_median_ms(self) -> float:
        return statistics.median(self.tower_ms)

    def to_json(self) -> dict[str, Any]:
        med = statistics.median
        f = self.flops
        tower = self.tower_median_ms
        return {
            "size": f"{self.width}x{self.height}",
            "width": self.width,
            "height": self.height,
            "grid_thw": list(self.grid_thw),
            "patches": f.patches,
            "image_tokens": self.image_tokens,
            "prompt_tokens": self.prompt_tokens,
            "repeats": self.repeats,
            "tower_ms": round(tower, 4),
            "tower_ms_min": round(min(self.tower_ms), 4),
            "tower_ms_max": round(max(self.tower_ms), 4),
            "tower_flops": f.total,
            "tower_flops_by_part": {
                "patch_embed": f.patch_embed,
                "qkv": f.qkv,
                "proj": f.proj,
                "attention": f.attention,
                "mlp": f.mlp,
                "merger": f.merger,
            },  # fmt: skip
            "tower_floor_ms": round(self.tower_floor_ms, 4),
            "tower_pct_floor": round(100.0 * self.tower_floor_ms / tower, 2),
            "tower_TFLOPs": round(f.total / tower / 1e9, 4),
            "ttft_image_ms": round(med(self.ttft_image_ms), 3),
            "submit_image_ms": round(med(self.submit_image_ms), 3),
            "prefill_image_ms": round(med(self.prefill_image_ms), 3),
            "ttft_text_ms": round(med(self.ttft_text_ms), 3),
            "prefill_text_ms": round(med(self.prefill_text_ms), 3),
            "ttft_image_minus_text_ms": round(med(self.ttft_image_ms) - med(self.ttft_text_ms), 3),
            "ttft_floor_ms": round(self.ttft_floor_ms, 4),
            "ttft_pct_floor": round(100.0 * self.ttft_floor_ms / med(self.ttft_image_ms), 2),
        }


@dataclass(frozen=True)
class ImageReport:
    header: RunHeader
    rows: tuple[ImageRow, ...]
    settings: dict[str, Any]
    assumptions: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        out = self.header.to_json()
        out.update(
            mode="image",
            images=[row.to_json() for row in self.rows],
            settings=self.settings,
            assumptions=list(self.assumptions),
        )
        return out


def _ms(x: float) -> str:
    return f"{x:.3g}" if x < 10 else f"{x:.1f}"


def render_image(report: ImageReport) -> str:
    lines = report.header.lines("--image")
    lines += [
        f"one image per request, repeats {report.settings['repeats']} (medians); tower: vision_embeddings "
        "alone, warm, on device-resident pixels",
        "",
        f"{'size':>11} {'grid':>11} {'tokens':>7} {'tower ms':>9} {'floor ms':>9} {'% floor':>8} "
        f"{'TFLOP':>7} | {'TTFT img':>9} {'submit':>7} {'TTFT txt':>9} {'img-txt':>8} {'floor':>7}",
    ]
    for row in report.rows:
        d = row.to_json()
        grid = "x".join(str(v) for v in row.grid_thw)
        lines.append(
            f"{d['size']:>11} {grid:>11} {row.image_tokens:>7} {_ms(d['tower_ms']):>9} "
            f"{_ms(d['tower_floor_ms']):>9} {d['tower_pct_floor']:>7.1f}% {row.flops.total / 1e12:>7.3g} | "
            f"{_ms(d['ttft_image_ms']):>9} {_ms(d['submit_image_ms']):>7} {_ms(d['ttft_text_ms']):>9} "
            f"{_ms(d['ttft_image_minus_text_ms']):>8} {_ms(d['ttft_floor_ms']):>7}"
        )
    lines += ["", *(f"note: {a}" for a in report.assumptions)]
    return "\n".join(lines)


ASSUMPTIONS = (
    VISION_ASSUMPTION,
    "tower floor = tower FLOPs / the measured matmul throughput (bf16 on CUDA); % floor = floor / measured",
    "tower ms: vision_embeddings(program.view.vision, ...) called directly with the image's pixel_values "
    "already on the device (the Program's own call adds their host-to-device copy), warm-up 1, CUDA "
    "events with each call synchronised",
    "TTFT img: a one-image chat request (a fresh random image each repeat, so the context cache could not "
    "serve it), submit -> first token: preprocessing on the caller (submit), the tower, the prefill; TTFT "
    "txt: a token-id prompt of the same token count; img-txt: what the image costs in place",
    "TTFT floor = (prefill FLOPs of the prompt's tokens + the tower's FLOPs) / the matmul throughput",
)


@dataclass(frozen=True)
class ImagePlan:
    sizes: tuple[tuple[int, int], ...]  # (width, height)
    repeats: int
    prefill_chunk: int


def _prepared(frontend: Any, width: int, height: int, seed: int) -> Any:
    prompt = frontend.prepare_chat(image_messages(random_image(width, height, seed)))
    if len(prompt.images) != 1:
        raise BenchError(f"the {width}x{height} prompt has {len(prompt.images)} images, 1 expected")
    return prompt


def run_image(
    options: BenchOptions, plan: ImagePlan, log: Callable[[str], None] = lambda _: None
) -> ImageReport:
    package, _ = options_package(options)
    variant = package.variant
    if variant.vision is None:
        raise ValueError(f"package {package.name!r} has no vision tower; --image needs one")
    sizing = [_prepared(sizing_frontend(options.artifact, package), w, h, 0) for w, h in plan.sizes]
    longest = max(len(p.token_ids) for p in sizing)
    if longest + REPLY_TOKENS > variant.max_position_embeddings:
        raise ValueError(
            f"the largest image prompt takes {longest} tokens but the model holds "
            f"{variant.max_position_embeddings}; give smaller --image sizes"
        )
    decode = BenchPlan(
        batches=(1,), context=1, decode_steps=1, prefill_tokens=longest, prefill_repeats=1,
        prefill_chunk=plan.prefill_chunk,
    )  # fmt: skip
    config = replace(
        engine_config(replace(options, plan=decode)),
        max_concurrency=1,
        queue_capacity=1,
        max_context=longest + REPLY_TOKENS,
        max_image_tokens=max(p.images[0].num_tokens for p in sizing),
    )
    probe, started = probe_and_start(options, config, log)
    header = run_header(started, probe)
    peak = probe.matmul_flops_per_s
    device = started.device
    view = started.program.view
    prompts = PromptSource(first_special_id(variant.special), options.seed)
    rows = []
    try:
        engine = started.engine
        driver = TimedDriver(engine, decode, prompts)
        from ninfer.targets.qwen3_6.vision import vision_embeddings

        kernels = started.program.kernels  # the Program's own table
        for i, (width, height) in enumerate(plan.sizes):
            prompt = _prepared(engine.frontend, width, height, options.seed)
            image = prompt.images[0]
            grid = tuple(int(v) for v in image.grid_thw)
            pixels = torch.from_numpy(np.array(image.pixel_values)).to(device)
            log(f"{width}x{height}: grid {grid}, {image.num_tokens} image tokens; tower x {plan.repeats}")

            def tower(pixels: torch.Tensor = pixels, grid: tuple[int, ...] = grid) -> torch.Tensor:
                with torch.inference_mode():
                    return vision_embeddings(view.vision, variant.vision, pixels, [grid], kernels)

            tower_s = timed_seconds(tower, device, plan.repeats, warmup=1)
            del pixels
            log(
                f"{width}x{height}: TTFT of the image prompt and of a text prompt of "
                f"{len(prompt.token_ids)} tokens"
            )
            image_samples, text_samples = [], []
            for r in range(plan.repeats + 1):  # the first of each: warm-up
                seed = options.seed + 1000 * (i + 1) + r
                image_samples.append(
                    driver.timed(
                        GenerationRequest(
                            messages=image_messages(random_image(width, height, seed)),
                            max_tokens=REPLY_TOKENS,
                            temperature=0.0,
                            ignore_eos=True,
                        )  # fmt: skip
                    )
                )
                text_samples.append(
                    driver.timed(
                        GenerationRequest(
                            prompt=prompts.take(len(prompt.token_ids)),
                            max_tokens=REPLY_TOKENS,
                            temperature=0.0,
                            ignore_eos=True,
                        )  # fmt: skip
                    )
                )
            image_samples, text_samples = image_samples[1:], text_samples[1:]
            if any(s.prompt_tokens != len(prompt.token_ids) for s in image_samples):
                raise BenchError(
                    f"{width}x{height}: the Engine's image prompts differ in length from the sizing"
                )
            flops = vision_flops(variant.vision, [grid])  # type: ignore[list-item]
            text_flops = prefill_flops(variant, len(prompt.token_ids)).total
            rows.append(
                ImageRow(
                    width=width,
                    height=height,
                    grid_thw=grid,  # type: ignore[arg-type]
                    image_tokens=image.num_tokens,
                    prompt_tokens=len(prompt.token_ids),
                    repeats=plan.repeats,
                    tower_ms=tuple(s * 1e3 for s in tower_s),
                    flops=flops,
                    tower_floor_ms=flops.total / peak * 1e3,
                    ttft_image_ms=tuple(s.ttft_s * 1e3 for s in image_samples),
                    submit_image_ms=tuple(s.submit_s * 1e3 for s in image_samples),
                    prefill_image_ms=tuple(s.prefill_s * 1e3 for s in image_samples),
                    ttft_text_ms=tuple(s.ttft_s * 1e3 for s in text_samples),
                    prefill_text_ms=tuple(s.prefill_s * 1e3 for s in text_samples),
                    ttft_floor_ms=(text_flops + flops.total) / peak * 1e3,
                )  # fmt: skip
            )
    finally:
        started.engine.close()
    settings = {
        "sizes": [f"{w}x{h}" for w, h in plan.sizes],
        "repeats": plan.repeats,
        "prefill_chunk": plan.prefill_chunk,
        "max_context": config.max_context,
        "max_image_tokens": config.max_image_tokens,
        "prefix_cache": config.prefix_cache,
        "cuda_graphs": options.cuda_graphs and device.type == "cuda",
        "kernels": resolve_kernels(device, options.kernels),
        "seed": options.seed,
    }
    return ImageReport(header, tuple(rows), settings, ASSUMPTIONS)


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    """``"448x448,1024x768"`` -> ((448, 448), (1024, 768)): width x height, each 1..MAX_SIDE."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        w, sep, h = part.partition("x")
        if not sep or not w.isdigit() or not h.isdigit():
            raise ValueError(f"expected WxH sizes such as 448x448, got {part!r}")
        width, height = int(w), int(h)
        if not (1 <= width <= MAX_SIDE and 1 <= height <= MAX_SIDE):
            raise ValueError(f"image sides must be 1..{MAX_SIDE}, got {part!r}")
        if max(width, height) > 200 * min(width, height):
            raise ValueError(f"{part!r}: the processor refuses an aspect ratio over 200")
        sizes.append((width, height))
    if not sizes:
        raise ValueError(f"expected WxH sizes such as 448x448, got {text!r}")
    return tuple(sizes)


def sizes_text(sizes: Sequence[tuple[int, int]]) -> str:
    return ",".join(f"{w}x{h}" for w, h in sizes)
