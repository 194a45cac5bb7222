"""Triton M-RoPE tables (`ninfer.ops.triton.rope`) against the reference `ninfer.ops.rope.mrope_cos_sin`."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.rope import mrope_cos_sin, mrope_inv_freq

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.rope")


def _positions(tokens: int, seed: int, text: bool, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if text:  # the model's text positions: one row expanded to T = H = W (stride 0 along the axis)
        return torch.randint(0, 262_144, (1, tokens), generator=gen).to(device).expand(3, -1)
    return torch.randint(0, 262_144, (3, tokens), generator=gen).to(device)


@pytest.mark.parametrize("tokens", [1, 7, 70])
@pytest.mark.parametrize("rotary_dim, section", [(64, (11, 11, 10)), (16, (3, 3, 2)), (8, (2, 1, 1))])
@pytest.mark.parametrize("text", [True, False])
def test_tables_match_the_reference(
    kernels: ModuleType, tokens: int, rotary_dim: int, section: tuple[int, int, int], text: bool
) -> None:
    """Every frequency from its own position row (image tokens: distinct T/H/W), both halves; the
    interpreter's cos / sin are numpy's, so equal to torch's up to fp32 rounding of the result."""
    positions = _positions(tokens, tokens + rotary_dim, text)
    cos, sin = kernels.mrope_cos_sin(positions, rotary_dim, 1e7, section)
    want_cos, want_sin = mrope_cos_sin(positions, rotary_dim, 1e7, section)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=2e-7)


def test_no_tokens_and_bad_positions(kernels: ModuleType) -> None:
    cos, sin = kernels.mrope_cos_sin(torch.zeros(3, 0, dtype=torch.long), 64, 1e7, (11, 11, 10))
    assert cos.shape == sin.shape == (0, 64)
    with pytest.raises(ValueError, match="positions must be integer"):
        kernels.mrope_cos_sin(torch.zeros(3, 4), 64, 1e7, (11, 11, 10))
    with pytest.raises(ValueError, match="positions must be integer"):
        kernels.mrope_cos_sin(torch.zeros(2, 4, dtype=torch.long), 64, 1e7, (11, 11, 10))


def test_inv_freq_is_built_once_per_device() -> None:
    """The frequencies are a shared constant (no kernels per step): one tensor for equal arguments."""
    first = mrope_inv_freq(64, 1e7, torch.device("cpu"))
    assert mrope_inv_freq(64, 1e7, torch.device("cpu")) is first
    assert mrope_inv_freq(64, 1e6, torch.device("cpu")) is not first
    exponents = torch.arange(0, 64, 2, dtype=torch.int64).float() / 64
    assert torch.equal(first, 1.0 / (1e7**exponents))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 8, 8192, 333])
@pytest.mark.parametrize("text", [True, False])
def test_tables_are_the_reference_bits_on_cuda(tokens: int, text: bool) -> None:
    """Qwen3.6's rotary dims (64 of 256, sections 11/11/10, theta 1e7): libdevice's cos / sin are the
    functions torch's CUDA kernels call, so the tables are bit-equal."""
    from ninfer.ops.triton.rope import mrope_cos_sin as fast

    positions = _positions(tokens, tokens, text, "cuda")
    assert (positions.stride(0) == 0) == text
    cos, sin = fast(positions, 64, 1e7, (11, 11, 10))
    want_cos, want_sin = mrope_cos_sin(positions, 64, 1e7, (11, 11, 10))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
