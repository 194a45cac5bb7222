"""Triton row argmax (`ninfer.ops.triton.argmax`) against `torch.argmax`: ties, NaN, -inf, widths."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.argmax")


@pytest.mark.parametrize("rows, cols", [(1, 1), (1, 5000), (3, 4097), (2, 17), (5, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rows(kernels: ModuleType, rows: int, cols: int, dtype: torch.dtype) -> None:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)).to(dtype)
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))


def test_ties_nan_and_infinities_as_torch(kernels: ModuleType) -> None:
    """The first of equal maxima (also across the first launch's blocks), the first NaN over any number,
    an all -inf row at 0, +inf over finite values."""
    x = torch.randn(5, 5000, generator=torch.Generator().manual_seed(1))
    x[0, 4100] = x[0, 100] = float("nan")
    x[1] = float("-inf")
    x[2, 10] = x[2, 4999] = x[2, 2048] = 1e9
    x[3, 4500] = float("inf")
    x[4, 3000] = float("nan")
    x[4, 10] = float("inf")
    got = kernels.argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert got.tolist() == [100, 0, 10, 4500, 3000]


def test_writes_into_out(kernels: ModuleType) -> None:
    x = torch.randn(3, 700, generator=torch.Generator().manual_seed(3))
    out = torch.full((3,), -5, dtype=torch.int64)
    assert kernels.argmax_rows(x, out) is out
    assert torch.equal(out, x.argmax(dim=-1))
    with pytest.raises(ValueError, match="out must be contiguous \\[3\\] int64"):
        kernels.argmax_rows(x, out.int())
    with pytest.raises(ValueError, match="out must be contiguous \\[3\\] int64"):
        kernels.argmax_rows(x, out[:2])


def test_strided_rows_and_bad_input(kernels: ModuleType) -> None:
    x = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))[::2]  # row stride 600
    assert torch.equal(kernels.argmax_rows(x), x.argmax(dim=-1))
    assert kernels.argmax_rows(torch.zeros(0, 9)).shape == (0,)
    with pytest.raises(ValueError, match="empty row"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(ValueError, match="unit stride"):
        kernels.argmax_rows(torch.zeros(9, 2).t())
    with pytest.raises(ValueError, match="unit stride"):  # fp64 would lose its precision in fp32
        kernels.argmax_rows(torch.zeros(2, 9, dtype=torch.float64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_vocabulary_rows_on_cuda(rows: int) -> None:
    """Qwen3.6's 248,320-wide logits, poisoned with repeated maxima and a NaN row."""
    from ninfer.ops.triton.argmax import argmax_rows

    x = torch.randn(rows, 248_320, device="cuda")
    x[0, 200_000] = x[0, 7] = 50.0
    if rows > 1:
        x[1, 123_456] = float("nan")
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
