"""Triton SwiGLU (`ninfer.ops.triton.activation`) against the reference `ninfer.ops.mlp.swiglu`."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.mlp import swiglu

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.activation")


@pytest.mark.parametrize("rows, width", [(1, 8), (5, 37), (3, 1500)])
def test_swiglu_on_strided_halves(kernels: ModuleType, rows: int, width: int) -> None:
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 3
    gate, up = gate_up.chunk(2, dim=-1)  # column slices with row stride 2 * width, as the MLP has them
    out = torch.full((rows, width), float("nan"))
    got = kernels.swiglu(gate, up, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, swiglu(gate, up), rtol=1e-6, atol=1e-6)


def test_swiglu_rounds_like_the_reference_in_fp16(kernels: ModuleType) -> None:
    gate, up = (
        (torch.randn(4, 2 * 96, generator=torch.Generator().manual_seed(9)) * 4).half().chunk(2, dim=-1)
    )
    got = kernels.swiglu(gate, up)
    assert got.dtype == torch.float16
    assert (got != swiglu(gate, up)).float().mean().item() < 0.02  # exp rounding may move a last bit


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, width", [(1, 17408), (3, 512), (4096, 17408)])
def test_swiglu_cuda_bf16_real_shapes(rows: int, width: int) -> None:
    from ninfer.ops.triton.activation import swiglu as fast

    gate_up = torch.randn(rows, 2 * width, device="cuda", dtype=torch.bfloat16) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    out = torch.full((rows, width), float("nan"), device="cuda", dtype=torch.bfloat16)
    got = fast(gate, up, out=out)
    ref = swiglu(gate, up)
    assert not got.isnan().any()
    assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2
