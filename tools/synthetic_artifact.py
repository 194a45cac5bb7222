"""Write a full-size `.ninfer` of a registered package with random weights (no checkpoint needed).

    python3 -m tools.synthetic_artifact PACKAGE PATH [--device auto|cpu|cuda] [--seed 0] [--storage bf16]

The GPU host has no real checkpoint, yet start-up (`ninfer bench ARTIFACT`: load from the page cache,
capture, warm up) must be timed on a file of the package's exact size. This writes one through
`ArtifactWriter`, as the converter would: identity ``package.identity(storage)``, the package's dims,
the schema's tensors in schema order (fp32-pinned ones stay fp32), the real Qwen3.6 tokenizer, the
package's chat template and a generation_config.json as frontend resources, and provenance saying the
weights are synthetic (seed, generator device). The values are the binder's own random weights
(`random_model_view`'s per-tensor generator, seeded by (seed, name)), so the file holds exactly the
tensors `random_model_view(variant, seed=seed, dtype=storage, device=device)` would bind.

Never more than a few tensors exist at once (the 27B package is 55.6 GB in bf16). Two stages overlap:
the calling thread draws a tensor on the device, casts it and copies it to host memory (on CUDA into
one of two reused pinned buffers, so the copy runs at full PCIe speed and no page is faulted twice); a
writer thread appends it (file write + the writer's CRC-32). The writer thread is the expected
bottleneck: CRC-32 runs at ~4 GB/s per core, and page-cache writes of tens of GB end up throttled to
the disk's write speed once the kernel's dirty-page limit is reached.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from ninfer.artifact import ArtifactWriter, TensorSpec
from ninfer.artifact.format import layout
from ninfer.targets.open import resolve_device
from ninfer.targets.package import STORAGE_PROFILES, Package
from ninfer.targets.qwen3_6.binder import random_weight
from ninfer.targets.qwen3_6.resources import chat_template, tokenizer_json
from ninfer.targets.qwen3_6.variant import SpecialTokens
from ninfer.targets.qwen3_6.view import target_dtype
from ninfer.targets.qwen3_6.weights import WeightSpec, weight_schema
from ninfer.targets.registry import PackageMismatch, get_package

__all__ = ["SyntheticArtifactError", "WriteReport", "main", "required_bytes", "write_synthetic_artifact"]

SOURCE = "tools.synthetic_artifact"
# room for the JSON header (~250 bytes per tensor) and the prefix; generous so the check never lies
HEADER_ALLOWANCE = 16 << 20
PINNED_BUFFERS = 2  # one being written, one being filled


class SyntheticArtifactError(Exception):
    """A refused request (unknown package or profile, existing path, too little disk space)."""


@dataclass(frozen=True)
class WriteReport:
    """What one write cost. ``produce_s``: drawing + casting + copying to host (calling thread, waits
    for a free staging buffer not counted); ``write_s``: `ArtifactWriter.write_tensor` (file write +
    CRC-32, writer thread); ``close_s``: header rewrite + fsync + rename. The first two overlap."""

    path: str
    package: str
    storage: str
    device: str
    tensors: int
    file_bytes: int
    seconds: float
    produce_s: float
    write_s: float
    close_s: float

    @property
    def gb_per_s(self) -> float:
        return self.file_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        return (
            f"wrote {self.file_bytes} bytes ({self.file_bytes / 1e9:.2f} GB, {self.tensors} tensors) in "
            f"{self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s): {self.path}"
        )


def generation_config(package: Package) -> dict[str, Any]:
    """Qwen3.6's sampling defaults, with the package's own end-of-sequence and padding ids."""
    special = package.variant.special
    return {
        "eos_token_id": list(special.eos),
        "pad_token_id": special.endoftext,
        "temperature": 1.0,
        "top_k": 20,
        "top_p": 0.95,
    }


def frontend_resources(package: Package) -> dict[str, bytes]:
    """The real tokenizer, the package's chat template and a generation config.

    A package with special ids of its own (the bundled demo) cannot use the bundled Qwen3.6 tokenizer;
    the demo takes its shipped artifact's resources, like ``bench --synthetic`` does.
    """
    if package.variant.special != SpecialTokens():
        from ninfer.artifact import Artifact
        from ninfer.cli.common import BUNDLED_PACKAGE, bundled_artifact

        if package.name != BUNDLED_PACKAGE:
            raise SyntheticArtifactError(
                f"package {package.name!r} has special token ids of its own and no bundled tokenizer"
            )
        with Artifact.open(bundled_artifact()) as bundled:
            return {name: bundled.frontend_resource(name) or b"" for name in bundled.frontend_names()}
    return {
        "tokenizer.json": tokenizer_json(),
        "chat_template": chat_template(package.chat_template).encode("utf-8"),
        "generation_config.json": json.dumps(generation_config(package), sort_keys=True).encode(),
    }


def tensor_specs(package: Package, storage: str) -> list[TensorSpec]:
    """The schema's tensors in order, stored in the profile's dtype (fp32-pinned ones in fp32)."""
    stored = getattr(torch, STORAGE_PROFILES[storage])
    return [
        TensorSpec(s.name, target_dtype(s, stored, None), s.shape) for s in weight_schema(package.variant)
    ]


def required_bytes(specs: list[TensorSpec], frontend: dict[str, bytes]) -> int:
    """Bytes the finished file needs on disk: the aligned payload plus a header allowance."""
    _, _, payload_nbytes = layout(specs, {name: len(data) for name, data in frontend.items()})
    return payload_nbytes + HEADER_ALLOWANCE


def _check_destination(path: Path, needed: int) -> None:
    if os.path.lexists(path):
        raise SyntheticArtifactError(f"{path}: already exists; refusing to overwrite it")
    if not path.parent.is_dir():
        raise SyntheticArtifactError(f"{path}: directory {path.parent} does not exist")
    free = shutil.disk_usage(path.parent).free
    partial = Path(str(path) + ".partial")
    if partial.is_file():  # a killed earlier run's leftover: the writer truncates it first
        free += partial.stat().st_size
    if free < needed:
        raise SyntheticArtifactError(
            f"{path}: needs {needed / 1e9:.3f} GB ({needed} bytes) but {path.parent} has "
            f"{free / 1e9:.3f} GB ({free} bytes) free"
        )


def _resolve_device(device: str) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise SyntheticArtifactError(f"device must be auto, cpu or cuda, got {device!r}")
    try:
        return resolve_device(device)
    except ValueError as exc:
        raise SyntheticArtifactError(f"--device cuda: {exc}") from exc


class _Progress:
    """Throttled progress lines on ``stream``: tensor i/N, GB written, GB/s since the start."""

    def __init__(
        self, total_tensors: int, total_bytes: int, interval_s: float, stream: TextIO | None
    ) -> None:
        self.total_tensors, self.total_bytes = total_tensors, total_bytes
        self.interval_s, self.stream = interval_s, stream
        self.started = time.perf_counter()
        self.last = self.started
        self.tensors = 0
        self.bytes = 0

    def advance(self, name: str, nbytes: int) -> None:
        self.tensors += 1
        self.bytes += nbytes
        now = time.perf_counter()
        if self.stream is None or (now - self.last < self.interval_s and self.tensors < self.total_tensors):
            return
        self.last = now
        elapsed = now - self.started
        rate = self.bytes / elapsed / 1e9 if elapsed > 0 else 0.0
        print(
            f"[synthetic] tensor {self.tensors}/{self.total_tensors}  "
            f"{self.bytes / 1e9:.2f}/{self.total_bytes / 1e9:.2f} GB  {rate:.2f} GB/s  "
            f"{elapsed:.1f} s  ({name})",
            file=self.stream,
            flush=True,
        )


@dataclass
class _Item:
    spec: TensorSpec
    tensor: torch.Tensor
    release: Callable[[], None]


class _HostStaging:
    """Where a drawn tensor lands in host memory before the writer takes it: ``PINNED_BUFFERS`` reused
    buffers of the largest tensor's size, pinned on CUDA (the copy is then a full-speed synchronous DMA
    and no page is faulted in twice). A buffer returns to the pool once its tensor is written, so the
    drawing thread runs at most one tensor ahead of the writer. The CPU path uses the same buffers
    (one extra memcpy) so that it exercises the same hand-over as the CUDA path."""

    def __init__(self, device: torch.device, largest: int) -> None:
        self.free: queue.Queue[torch.Tensor] = queue.Queue()
        pin = device.type == "cuda"
        for _ in range(PINNED_BUFFERS):
            self.free.put(torch.empty(max(largest, 1), dtype=torch.uint8, pin_memory=pin))

    def acquire(self) -> torch.Tensor:
        return self.free.get()  # blocks until the writer has finished with one

    def to_host(self, buffer: torch.Tensor, spec: TensorSpec, tensor: torch.Tensor) -> _Item:
        host = buffer[: spec.nbytes].view(spec.dtype).view(spec.shape)
        host.copy_(tensor)  # device -> host is synchronous: `host` is complete on return
        return _Item(spec, host, lambda: self.free.put(buffer))


def _draw(
    spec: WeightSpec, package: Package, dtype: torch.dtype, seed: int, generator: torch.Generator
) -> torch.Tensor:
    """One tensor exactly as `random_model_view` draws it, cast to the stored dtype."""
    return random_weight(spec, package.variant, seed, generator).to(dtype)


def write_synthetic_artifact(
    package_name: str,
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    storage: str = "bf16",
    device: str = "auto",
    progress: TextIO | None = None,
    progress_interval_s: float = 5.0,
) -> WriteReport:
    """Write ``path``: package ``package_name`` with random weights in storage profile ``storage``.

    Raises `SyntheticArtifactError` (before creating anything) for an unknown package or profile, an
    existing ``path``, a missing directory, or less free space than `required_bytes`. Any failure while
    writing leaves no file (the writer removes its ``.partial``). ``progress``: a stream for progress
    lines (one every ``progress_interval_s`` and one at the end); None is silent.
    """
    try:
        package = get_package(package_name)
    except PackageMismatch as e:
        raise SyntheticArtifactError(str(e)) from None
    if storage not in STORAGE_PROFILES:
        raise SyntheticArtifactError(
            f"unknown storage profile {storage!r}; known: {', '.join(STORAGE_PROFILES)}"
        )
    target = Path(path)
    torch_device = _resolve_device(device)
    schema = weight_schema(package.variant)
    specs = tensor_specs(package, storage)
    frontend = frontend_resources(package)
    _check_destination(target, required_bytes(specs, frontend))

    total = sum(s.nbytes for s in specs)
    started = time.perf_counter()
    meter = _Progress(len(specs), total, progress_interval_s, progress)
    staging = _HostStaging(torch_device, max(s.nbytes for s in specs))
    generator = torch.Generator(device=torch_device)
    work: queue.Queue[_Item | None] = queue.Queue(maxsize=1)
    failed = threading.Event()
    failure: list[BaseException] = []
    write_s = 0.0

    with ArtifactWriter(
        target,
        identity=package.identity(storage),
        dims=package.variant.dims(),
        tensors=specs,
        frontend=frontend,
        provenance={
            "source": SOURCE,
            "synthetic": True,
            "seed": seed,
            "generator": "ninfer.targets.qwen3_6.binder random weights, drawn in fp32 and cast",
            "generator_device": torch_device.type,  # CPU and CUDA streams differ for one seed
        },
    ) as writer:

        def write_all() -> None:
            nonlocal write_s
            while (item := work.get()) is not None:
                try:
                    if not failed.is_set():
                        t0 = time.perf_counter()
                        writer.write_tensor(item.spec.name, item.tensor)
                        write_s += time.perf_counter() - t0
                        meter.advance(item.spec.name, item.spec.nbytes)
                except BaseException as e:  # handed to the calling thread, which re-raises it
                    failure.append(e)
                    failed.set()
                finally:
                    item.release()  # also while draining after a failure, so the producer never blocks

        consumer = threading.Thread(target=write_all, name="synthetic-artifact-writer", daemon=True)
        consumer.start()
        produce_s = 0.0
        try:
            for spec, stored in zip(schema, specs):
                if failed.is_set():
                    break
                buffer = staging.acquire()  # waiting for the writer is not counted in produce_s
                t0 = time.perf_counter()
                tensor = _draw(spec, package, stored.dtype, seed, generator)
                item = staging.to_host(buffer, stored, tensor)
                del tensor  # the device copy is not needed once it is in host memory
                produce_s += time.perf_counter() - t0
                work.put(item)
        finally:
            work.put(None)
            consumer.join()
        if failure:
            raise failure[0]
        t0 = time.perf_counter()
        writer.close()
        close_s = time.perf_counter() - t0

    return WriteReport(
        path=str(target),
        package=package.name,
        storage=storage,
        device=torch_device.type,
        tensors=len(specs),
        file_bytes=target.stat().st_size,
        seconds=time.perf_counter() - started,
        produce_s=produce_s,
        write_s=write_s,
        close_s=close_s,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m tools.synthetic_artifact", description=__doc__.split("\n")[0]
    )
    parser.add_argument("package", help="a registered package, e.g. qwen3_6_27b")
    parser.add_argument("path", help="the .ninfer file to create (must not exist)")
    parser.add_argument(
        "--device",
        default="auto",
        choices=("auto", "cpu", "cuda"),
        help="where weights are drawn (auto: CUDA when present, much faster)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--storage",
        default="bf16",
        choices=tuple(STORAGE_PROFILES),
        help="storage profile (real 27B/35B checkpoints are bf16)",
    )
    parser.add_argument("--progress-interval", type=float, default=5.0, help="seconds between progress lines")
    args = parser.parse_args(argv)
    try:
        report = write_synthetic_artifact(
            args.package,
            args.path,
            seed=args.seed,
            storage=args.storage,
            device=args.device,
            progress=sys.stderr,
            progress_interval_s=args.progress_interval,
        )
    except SyntheticArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"[synthetic] draw+copy to host {report.produce_s:.1f} s, write+crc32 {report.write_s:.1f} s, "
        f"fsync+rename {report.close_s:.1f} s (the first two overlap)",
        file=sys.stderr,
    )
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
