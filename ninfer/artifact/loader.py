"""Streams host tensors (typically an artifact's mapped tensors) into preallocated device tensors.

Loading a model is one long host-to-device copy, so it is shaped for the PCIe link rather than for
the tensors:

- Sources are read in file order into a few large reusable staging buffers (pinned host memory for a
  CUDA target, ``DEFAULT_STAGING_BYTES`` each). Many small tensors pack into one buffer; a tensor larger
  than a buffer is split at element boundaries across several. Each piece sits at an aligned offset so
  it can be reinterpreted in its stored dtype in place.
- Double buffering: while the side stream copies one buffer to the device, the host fills the next one
  (a plain memcpy out of the mapping, which torch runs on its intra-op threads and which takes the
  page faults). A buffer is refilled only after the event recorded behind its last copy has fired.
- Pieces of at least ``_DIRECT_MIN_BYTES`` that keep their dtype go straight from the pinned buffer into
  their final place (one DMA each). Small pieces and pieces that change dtype travel as one transfer
  per run of consecutive pieces into a device staging buffer, from which a device copy (casting where
  the destination dtype differs) puts each in its final place: small tensors cost one DMA for the lot,
  and a cast never happens on the host.
- Destinations are the caller's: the loader allocates nothing of model size, so peak device memory is
  the model plus one staging buffer.

On a CPU target the same plan runs with ordinary host buffers and synchronous copies (no streams).
`LoadReport` carries the bytes moved, the seconds it took and the resulting GB/s.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ninfer.artifact.reader import Artifact

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "LoadReport",
    "StagedPiece",
    "load_artifact_tensors",
    "plan_batches",
    "stream_tensors",
]

DEFAULT_STAGING_BYTES = 256 << 20
# offset granularity inside a staging buffer: any dtype can be viewed in place, DMA starts aligned
_PIECE_ALIGNMENT = 256
# below this a piece rides in its batch's packed transfer instead of taking a DMA of its own
_DIRECT_MIN_BYTES = 1 << 20
log = logging.getLogger("ninfer.load")
_LOG_INTERVAL_S = 5.0  # seconds between two progress log lines
_PROGRESS_INTERVAL_S = 0.1


@dataclass(frozen=True)
class LoadReport:
    """What one load moved and how fast. GB are 10^9 bytes.

    ``nbytes`` counts the source bytes as stored (before any cast); ``seconds`` is wall time from the
    first staging allocation until the last copy finished on the device. ``zero_copy`` marks a load
    that bound the mapped bytes without copying (then ``nbytes`` is 0).
    """

    nbytes: int
    seconds: float
    num_tensors: int
    num_batches: int  # staging buffer fills
    device: str
    zero_copy: bool = False

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        if self.zero_copy:
            return f"zero-copy mapping on {self.device} ({self.seconds:.2f} s)"
        return (
            f"{self.nbytes / 1e9:.2f} GB to {self.device} in {self.seconds:.2f} s "
            f"({self.gb_per_s:.1f} GB/s, {self.num_tensors} tensors, {self.num_batches} staging fills)"
        )


@dataclass(frozen=True)
class StagedPiece:
    """A byte range of one source tensor and where it sits in its batch's staging buffer."""

    tensor: int  # index into the sequence of tensors being streamed
    start: int  # byte offset inside the source tensor (a multiple of its element size)
    nbytes: int
    offset: int  # byte offset inside the staging buffer (a multiple of _PIECE_ALIGNMENT)


def plan_batches(
    sizes: Sequence[tuple[int, int]], staging_bytes: int, alignment: int = _PIECE_ALIGNMENT
) -> list[list[StagedPiece]]:
    """Pack tensors of ``(nbytes, itemsize)`` in order into batches of at most ``staging_bytes`` bytes.

    Each piece starts at an ``alignment``-aligned offset; a tensor that does not fit in what is left of
    a batch fills it (split on an element boundary) and continues in the next. Empty tensors get none.
    """
    if staging_bytes < alignment or staging_bytes % alignment:
        raise ValueError(f"staging_bytes {staging_bytes} must be a positive multiple of {alignment}")
    if any(itemsize > alignment or alignment % itemsize for _, itemsize in sizes):
        raise ValueError(f"element sizes must divide the alignment {alignment}")
    batches: list[list[StagedPiece]] = []
    batch: list[StagedPiece] = []
    cursor = 0
    for index, (nbytes, itemsize) in enumerate(sizes):
        start = 0
        while start < nbytes:
            offset = -(-cursor // alignment) * alignment
            room = staging_bytes - offset
            take = min(nbytes - start, room - room % itemsize)
            if take <= 0:  # the batch is full: close it, the piece starts the next one
                batches.append(batch)
                batch, cursor = [], 0
                continue
            batch.append(StagedPiece(index, start, take, offset))
            cursor = offset + take
            start += take
    if batch:
        batches.append(batch)
    return batches


def load_artifact_tensors(
    artifact: Artifact,
    destinations: Mapping[str, torch.Tensor],
    *,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    num_buffers: int = 2,
    progress: bool = False,
) -> LoadReport:
    """Copy each named artifact tensor into its destination (same numel, contiguous), in file order.

    The destinations' dtype may differ from the stored one: the cast happens on the destination device.
    """
    order = sorted(destinations, key=lambda name: artifact.descriptor(name).offset)
    pairs = [(artifact.tensor(name), destinations[name]) for name in order]
    return stream_tensors(pairs, staging_bytes=staging_bytes, num_buffers=num_buffers, progress=progress)


def stream_tensors(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    *,
    staging_bytes: int = DEFAULT_STAGING_BYTES,
    num_buffers: int = 2,
    progress: bool = False,
) -> LoadReport:
    """Copy every ``(source, destination)`` pair through the staging buffers; see the module docstring.

    Sources are contiguous host tensors; destinations are contiguous tensors of the same numel, all on
    one device, in any dtype (a different dtype is cast on that device). Returns once every copy has
    finished; ``progress`` draws a one-line progress report on stderr.
    """
    if num_buffers < 1:
        raise ValueError("num_buffers must be at least 1")
    _check_pairs(pairs)
    started = time.perf_counter()
    total = sum(src.nbytes for src, _ in pairs)
    devices = {dst.device for _, dst in pairs}
    device = devices.pop() if devices else torch.device("cpu")
    if not total:
        return LoadReport(0, time.perf_counter() - started, len(pairs), 0, str(device))
    # no buffer larger than what there is to move, padding included (a tiny model need not pin 512 MiB)
    padded = total + len(pairs) * _PIECE_ALIGNMENT
    staging_bytes = min(staging_bytes, -(-padded // _PIECE_ALIGNMENT) * _PIECE_ALIGNMENT)
    batches = plan_batches([(src.nbytes, src.element_size()) for src, _ in pairs], staging_bytes)
    sources = [src.reshape(-1).view(torch.uint8) for src, _ in pairs]
    targets = [dst.view(-1) for _, dst in pairs]
    dtypes = [src.dtype for src, _ in pairs]
    meter: _Progress | None = None
    if progress:
        meter = _Progress(total, str(device))
    elif log.isEnabledFor(logging.INFO):  # a server's log (ninfer serve configures it): progress lines
        meter = _LoggedProgress(total, str(device))
    if device.type == "cuda":
        _stream_cuda(batches, sources, targets, dtypes, staging_bytes, num_buffers, device, meter)
    else:
        _stream_host(batches, sources, targets, dtypes, staging_bytes, meter)
    seconds = time.perf_counter() - started
    report = LoadReport(total, seconds, len(pairs), len(batches), str(device))
    if meter is not None:
        meter.finish(report)
    return report


# ---- the two pipelines --------------------------------------------------------------------------


def _stream_cuda(
    batches: list[list[StagedPiece]],
    sources: list[torch.Tensor],
    targets: list[torch.Tensor],
    dtypes: list[torch.dtype],
    staging_bytes: int,
    num_buffers: int,
    device: torch.device,
    meter: _Progress | None,
) -> None:
    num_buffers = min(num_buffers, len(batches))
    pinned = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(num_buffers)]
    drained = [torch.cuda.Event() for _ in range(num_buffers)]  # "this pinned buffer may be refilled"
    side = torch.cuda.Stream(device)
    current = torch.cuda.current_stream(device)
    # the destinations were just allocated on the current stream: its pending work on recycled memory
    # must finish before the side stream writes there
    side.wait_stream(current)
    packed = any(not _is_direct(piece, targets, dtypes) for batch in batches for piece in batch)
    # one device staging buffer suffices: whatever reads it is ordered behind its fill on the side stream
    device_stage = torch.empty(staging_bytes if packed else 0, dtype=torch.uint8, device=device)
    for i, batch in enumerate(batches):
        slot = i % num_buffers
        host = pinned[slot]
        drained[slot].synchronize()  # its previous H2D copies have completed
        _fill(host, batch, sources)
        with torch.cuda.stream(side):
            runs: list[list[StagedPiece]] = []  # consecutive packed pieces: one transfer per run
            run_open = False
            for piece in batch:
                if _is_direct(piece, targets, dtypes):
                    _place(piece, host, targets, dtypes, non_blocking=True)
                    run_open = False
                elif run_open:
                    runs[-1].append(piece)
                else:
                    runs.append([piece])
                    run_open = True
            for run in runs:
                lo, hi = run[0].offset, run[-1].offset + run[-1].nbytes
                device_stage[lo:hi].copy_(host[lo:hi], non_blocking=True)
            drained[slot].record(side)
            for run in runs:
                for piece in run:
                    _place(piece, device_stage, targets, dtypes, non_blocking=False)
        if meter is not None:
            meter.advance(sum(piece.nbytes for piece in batch))
    current.wait_stream(side)
    side.synchronize()


def _stream_host(
    batches: list[list[StagedPiece]],
    sources: list[torch.Tensor],
    targets: list[torch.Tensor],
    dtypes: list[torch.dtype],
    staging_bytes: int,
    meter: _Progress | None,
) -> None:
    # synchronous, so one buffer: the plan (offsets, splits) is the one the CUDA pipeline runs
    staging = torch.empty(staging_bytes, dtype=torch.uint8)
    for batch in batches:
        _fill(staging, batch, sources)
        for piece in batch:
            _place(piece, staging, targets, dtypes, non_blocking=False)
        if meter is not None:
            meter.advance(sum(piece.nbytes for piece in batch))


def _fill(buffer: torch.Tensor, batch: list[StagedPiece], sources: list[torch.Tensor]) -> None:
    """Host memcpy of a batch's pieces from their sources into the staging buffer."""
    for piece in batch:
        src = sources[piece.tensor][piece.start : piece.start + piece.nbytes]
        buffer[piece.offset : piece.offset + piece.nbytes].copy_(src)


def _place(
    piece: StagedPiece,
    buffer: torch.Tensor,
    targets: list[torch.Tensor],
    dtypes: list[torch.dtype],
    *,
    non_blocking: bool,
) -> None:
    """Copy a piece from ``buffer`` (at its staging offset) into its elements of the destination."""
    dtype = dtypes[piece.tensor]
    first, count = piece.start // dtype.itemsize, piece.nbytes // dtype.itemsize
    staged = buffer[piece.offset : piece.offset + piece.nbytes].view(dtype)
    targets[piece.tensor][first : first + count].copy_(staged, non_blocking=non_blocking)


def _is_direct(piece: StagedPiece, targets: list[torch.Tensor], dtypes: list[torch.dtype]) -> bool:
    """Whether a piece goes straight from pinned memory to its destination: large and not cast."""
    return piece.nbytes >= _DIRECT_MIN_BYTES and targets[piece.tensor].dtype == dtypes[piece.tensor]


def _check_pairs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    devices = {dst.device for _, dst in pairs}
    if len(devices) > 1:
        raise ValueError(f"destinations span several devices: {sorted(map(str, devices))}")
    for i, (src, dst) in enumerate(pairs):
        if src.device.type != "cpu" or not src.is_contiguous():
            raise ValueError(f"source {i} must be a contiguous host tensor")
        if not dst.is_contiguous() or dst.numel() != src.numel():
            raise ValueError(
                f"destination {i} must be contiguous with the source's {src.numel()} elements "
                f"(has {dst.numel()}, contiguous={dst.is_contiguous()})"
            )


class _Progress:
    """One self-overwriting stderr line, redrawn at most every _PROGRESS_INTERVAL_S seconds."""

    def __init__(self, total: int, device: str) -> None:
        self.total, self.device = total, device
        self.done = 0
        self.started = self.drawn = time.perf_counter()

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self.drawn >= _PROGRESS_INTERVAL_S:
            self.drawn = now
            rate = self.done / max(now - self.started, 1e-9) / 1e9
            self._draw(
                f"loading weights to {self.device}: {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                f"({100 * self.done / self.total:.0f}%, {rate:.1f} GB/s)"
            )

    def finish(self, report: LoadReport) -> None:
        self._draw(f"loaded weights: {report}", end="\n")

    @staticmethod
    def _draw(line: str, end: str = "") -> None:
        # padded so that a shorter line fully covers the previous one
        sys.stderr.write("\r" + line.ljust(100) + end)
        sys.stderr.flush()


class _LoggedProgress(_Progress):
    """Progress as ``ninfer.load`` log lines: one every _LOG_INTERVAL_S seconds, and the total."""

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self.drawn >= _LOG_INTERVAL_S:
            self.drawn = now
            rate = self.done / max(now - self.started, 1e-9) / 1e9
            log.info(
                "loading weights device=%s done_GB=%.2f total_GB=%.2f percent=%.0f GBps=%.1f",
                self.device, self.done / 1e9, self.total / 1e9, 100 * self.done / self.total, rate,
            )  # fmt: skip

    def finish(self, report: LoadReport) -> None:
        log.info(
            "weights loaded device=%s GB=%.2f seconds=%.2f GBps=%.1f tensors=%d",
            report.device, report.nbytes / 1e9, report.seconds, report.gb_per_s, report.num_tensors,
        )  # fmt: skip
