"""The staging loader: batch planning (packing, splitting, alignment), exact copies and casts, the report.

CPU tests run the loader's host pipeline, which executes the very plan the CUDA pipeline runs (same
batches, same offsets, same per-piece casts), at tiny staging sizes so that tensors both pack and split.
`gpu` tests run the pinned, double-buffered pipeline against the CPU result.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer.artifact import Artifact
from ninfer.artifact.loader import LoadReport, load_artifact_tensors, plan_batches, stream_tensors

torch.set_num_threads(1)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

KIB = 1024


def _check_plan(sizes: list[tuple[int, int]], staging: int, alignment: int = 256) -> None:
    batches = plan_batches(sizes, staging, alignment)
    covered = {i: 0 for i in range(len(sizes))}
    order = []
    for batch in batches:
        assert batch, "no empty batch"
        end = 0
        for piece in batch:
            nbytes, itemsize = sizes[piece.tensor]
            assert piece.offset % alignment == 0 and piece.offset >= end  # aligned, no overlap
            assert piece.start % itemsize == 0 and piece.nbytes % itemsize == 0 and piece.nbytes > 0
            assert piece.start == covered[piece.tensor]  # a tensor's pieces are consecutive and in order
            covered[piece.tensor] += piece.nbytes
            end = piece.offset + piece.nbytes
            order.append(piece.tensor)
        assert end <= staging
    assert covered == {i: nbytes for i, (nbytes, _) in enumerate(sizes)}  # every byte exactly once
    assert order == sorted(order)  # file order is kept


def test_plan_packs_small_tensors_and_splits_large_ones() -> None:
    staging = 4 * KIB
    sizes = [(64 * 4, 4), (3 * 2, 2), (10_000 * 4, 4), (100 * 2, 2), (8, 8), (0, 4), (4096, 4)]
    _check_plan(sizes, staging)
    batches = plan_batches(sizes, staging)
    first = {piece.tensor for piece in batches[0]}
    assert {0, 1, 2} <= first  # two small tensors and the head of the large one share the first buffer
    spans = sum(1 for batch in batches if any(p.tensor == 2 for p in batch))
    head = staging - 512  # what the first buffer has left after two aligned small tensors
    assert spans == 1 + -(-(10_000 * 4 - head) // staging)  # split, filling every buffer it touches
    assert all(piece.tensor != 5 for batch in batches for piece in batch)  # empty tensors move nothing
    # a tensor that exactly fills a buffer, after the previous batch filled up exactly
    assert [len(b) for b in plan_batches([(4096, 4), (4096, 4)], 4096)] == [1, 1]


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(
        st.tuples(st.integers(0, 3000), st.sampled_from([1, 2, 4, 8])).map(lambda s: (s[0] * s[1], s[1])),
        max_size=12,
    ),
    staging_blocks=st.integers(1, 8),
    alignment=st.sampled_from([8, 64, 256]),
)
def test_plan_invariants(sizes: list[tuple[int, int]], staging_blocks: int, alignment: int) -> None:
    _check_plan(sizes, staging_blocks * alignment, alignment)


def test_plan_refuses_bad_staging_sizes() -> None:
    with pytest.raises(ValueError, match="multiple"):
        plan_batches([(16, 4)], 1000)
    with pytest.raises(ValueError, match="element sizes"):
        plan_batches([(16, 16)], 256, alignment=8)


def _pairs(device: str, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(source, NaN-poisoned destination) pairs: small and large, cast and kept, several dtypes."""
    layout = [
        ((7,), torch.float32, torch.bfloat16),
        ((64,), torch.float32, torch.float32),
        ((3000, 5), torch.float32, torch.bfloat16),  # 60 KB: split at 4 KiB staging
        ((2,), torch.bfloat16, torch.float32),
        ((33, 17), torch.bfloat16, torch.bfloat16),
        ((0, 4), torch.float32, torch.float32),
        ((5000,), torch.float16, torch.float32),
        ((1,), torch.float32, torch.float32),
        ((700, 3), torch.float32, torch.float32),
    ]
    pairs = []
    for shape, stored, target in layout:
        src = torch.randn(shape, generator=generator).to(stored)
        pairs.append((src, torch.full(shape, float("nan"), dtype=target, device=device)))
    return pairs


@pytest.mark.parametrize(("staging", "batches"), [(4 * KIB, 20), (64 * KIB, 2), (1 << 20, 1)])
def test_stream_copies_and_casts_exactly_on_cpu(staging: int, batches: int) -> None:
    pairs = _pairs("cpu", torch.Generator().manual_seed(staging))
    report = stream_tensors(pairs, staging_bytes=staging)
    for i, (src, dst) in enumerate(pairs):
        assert torch.equal(dst, src.to(dst.dtype)), i
    assert report.nbytes == sum(src.nbytes for src, _ in pairs)
    assert report.num_tensors == len(pairs) and report.device == "cpu" and not report.zero_copy
    assert report.num_batches == batches  # ~80 KB: split over 4 KiB buffers, packed into one 1 MiB buffer


def test_stream_writes_into_views_without_touching_their_neighbours() -> None:
    """Destinations may be row blocks of one buffer (the binder's stacked groups)."""
    buffer = torch.full((10, 8), -1.0)
    sources = [torch.randn(3, 8), torch.randn(5, 8)]
    stream_tensors([(sources[0], buffer[1:4]), (sources[1], buffer[5:10])], staging_bytes=256)
    assert torch.equal(buffer[1:4], sources[0]) and torch.equal(buffer[5:10], sources[1])
    assert (buffer[0] == -1).all() and (buffer[4] == -1).all()


def test_stream_refuses_mismatched_pairs() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        stream_tensors([(torch.zeros(4, 4), torch.zeros(4, 4).t())])
    with pytest.raises(ValueError, match="elements"):
        stream_tensors([(torch.zeros(4), torch.zeros(5))])
    with pytest.raises(ValueError, match="host"):
        stream_tensors([(torch.zeros(4, 4).t(), torch.zeros(16))])


def test_progress_line_and_report_text(capsys: pytest.CaptureFixture[str]) -> None:
    pairs = _pairs("cpu", torch.Generator().manual_seed(0))
    report = stream_tensors(pairs, staging_bytes=4 * KIB, progress=True)
    err = capsys.readouterr().err
    assert err.endswith("\n") and "loaded weights:" in err and f"{report.nbytes / 1e9:.2f} GB" in err
    assert report.gb_per_s > 0 and "GB/s" in str(report)
    assert LoadReport(0, 0.0, 0, 0, "cpu").gb_per_s == 0.0
    assert "zero-copy" in str(LoadReport(0, 0.01, 3, 0, "cpu", zero_copy=True))


def test_load_artifact_tensors_in_file_order(tiny_artifact: Path) -> None:
    with Artifact.open(tiny_artifact) as artifact:
        names = [n for n in artifact.tensor_names() if not n.startswith("embed") and "lm_head" not in n]
        names.reverse()  # the loader reads in file order whatever the mapping's order
        dests = {
            n: torch.full(artifact.descriptor(n).shape, float("nan"), dtype=torch.float16) for n in names
        }
        report = load_artifact_tensors(artifact, dests, staging_bytes=4 * KIB)
        for name in names:
            assert torch.equal(dests[name], artifact.tensor(name).to(torch.float16)), name
        assert report.nbytes == sum(artifact.descriptor(n).nbytes for n in names)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("staging", [4 * KIB, 2 << 20, 256 << 20])
@pytest.mark.parametrize("num_buffers", [1, 2, 3])
def test_stream_to_cuda_equals_host(staging: int, num_buffers: int) -> None:
    generator = torch.Generator().manual_seed(staging + num_buffers)
    pairs = _pairs("cuda", generator)
    # large enough for direct DMA pieces (>= 1 MiB, no cast) next to packed and cast ones
    large = [(((1 << 19) + 3,), torch.float32, torch.float32), ((3, 1 << 18), torch.bfloat16, torch.float32)]
    for shape, stored, target in large:
        src = torch.randn(shape, generator=generator).to(stored)
        pairs.append((src, torch.full(shape, float("nan"), dtype=target, device="cuda")))
    report = stream_tensors(pairs, staging_bytes=staging, num_buffers=num_buffers)
    for i, (src, dst) in enumerate(pairs):
        assert dst.device.type == "cuda"
        assert not dst.isnan().any(), i
        assert torch.equal(dst.cpu(), src.to(dst.dtype)), i
    assert report.nbytes == sum(src.nbytes for src, _ in pairs) and report.device.startswith("cuda")


@pytest.mark.gpu
@gpu
def test_stream_throughput_at_27b_layer_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    """Four 27B GDN layers' bf16 weights (~3 GB) from host memory; prints GB/s next to plain ``.to``."""
    shapes = [(10240, 5120), (6144, 5120), (48, 5120), (48, 5120), (10240, 1, 4), (48,), (48,), (128,)]
    shapes += [(5120, 6144), (17408, 5120), (17408, 5120), (5120, 17408), (5120,), (5120,)]
    sources = [
        torch.empty(shape, dtype=torch.bfloat16).random_(-256, 256) for _ in range(4) for shape in shapes
    ]
    pairs = [(src, torch.full(src.shape, float("nan"), dtype=src.dtype, device="cuda")) for src in sources]
    stream_tensors(pairs[:2], staging_bytes=1 << 20)  # CUDA context, pinned allocator and streams warm
    report = stream_tensors(pairs)
    torch.cuda.synchronize()
    started = time.perf_counter()
    baseline = [src.to("cuda") for src in sources]
    torch.cuda.synchronize()
    plain_s = time.perf_counter() - started
    for (_, dst), want in zip(pairs, baseline):
        assert torch.equal(dst, want)
    with capsys.disabled():
        print(f"\nstaged loader: {report}; plain .to('cuda'): {report.nbytes / plain_s / 1e9:.1f} GB/s")
    assert report.gb_per_s > 1.0
