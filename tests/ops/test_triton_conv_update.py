"""Triton conv decode step over the slot pool (`ninfer.ops.triton.conv_update`) against the reference.

The reference is what the model's decode path does: gather the rows' windows (zeros for fresh rows),
`causal_conv1d_update`, then `index_copy_` the new windows into the output slots. CPU tests run the
kernel in the Triton interpreter child (fp32, tiny shapes); `gpu` tests run it compiled at the real
conv widths in bf16.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.conv import causal_conv1d_update

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.conv_update")


def _reference(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    fresh: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, pool after the step) as model.gdn_mixer computes them; the given pool is not modified."""
    window_in = torch.where(fresh[:, None, None], 0, pool.index_select(0, state_in))
    y, new_window = causal_conv1d_update(x, window_in, weight)
    pool_after = pool.clone()
    pool_after.index_copy_(0, state_out, new_window.to(pool.dtype))
    return y, pool_after


def _inputs(
    batch: int, channels: int, kernel: int, slots: int, dtype: torch.dtype, gen: torch.Generator, device: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x as a column slice of a wider projection output (strided rows), a random pool, weight [C, K]."""
    wide = torch.randn(batch, channels + 24, generator=gen).to(dtype)
    x = wide[:, 8 : 8 + channels]
    pool = torch.randn(slots, channels, kernel - 1, generator=gen).to(dtype)
    weight = (torch.randn(channels, kernel, generator=gen) * 0.5).to(dtype)
    return x.to(device), pool.to(device), weight.to(device)


@pytest.mark.parametrize("block_c", [16, 64], ids=["channel-blocks", "one-block"])
@pytest.mark.parametrize("kernel", [4, 3])
def test_conv_update_slots_matches_reference(kernels: ModuleType, block_c: int, kernel: int) -> None:
    gen = torch.Generator().manual_seed(block_c + kernel)
    batch, channels, slots = 5, 40, 9  # 40 channels: not a multiple of the 16-channel block
    x, pool, weight = _inputs(batch, channels, kernel, slots, torch.float32, gen, "cpu")
    assert x.stride(0) != channels and x.stride(1) == 1
    state_in = torch.tensor([7, 2, 5, 0, 3])  # not sorted
    state_out = torch.tensor([7, 4, 1, 0, 8])  # rows 0 and 3 update in place, others move
    fresh = torch.tensor([False, True, False, False, True])
    y_ref, pool_ref = _reference(x, pool, weight, state_in, state_out, fresh)
    out = torch.full((batch, channels), float("nan"))

    y = kernels.causal_conv1d_update_slots(
        x, pool, weight, state_in, state_out, fresh, out=out, block_c=block_c
    )

    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    # new windows are copies of inputs: exact; untouched slots (6 and the read-only ones) unchanged
    assert torch.equal(pool, pool_ref)


def test_conv_update_fresh_row_ignores_its_slot_and_pool_untouched_elsewhere(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(5)
    batch, channels, kernel, slots = 3, 24, 4, 6
    x, pool, weight = _inputs(batch, channels, kernel, slots, torch.float32, gen, "cpu")
    pool[5] = float("nan")  # a fresh row's state_in slot holds garbage: it must not be read
    state_in = torch.tensor([5, 1, 3])
    state_out = torch.tensor([2, 1, 4])
    fresh = torch.tensor([True, False, False])
    before = pool.clone()
    y_ref, pool_ref = _reference(x, pool.nan_to_num(), weight, state_in, state_out, fresh)

    y = kernels.causal_conv1d_update_slots(x, pool, weight, state_in, state_out, fresh, block_c=16)

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    written = [2, 1, 4]
    torch.testing.assert_close(pool[written], pool_ref[written], rtol=0, atol=0)
    untouched = [0, 3, 5]
    assert torch.equal(pool[untouched].nan_to_num(), before[untouched].nan_to_num())
    assert pool[5].isnan().all()
    # the fresh row's new window is [0, 0, x]: the zero window shifted by its input
    assert torch.equal(pool[2][:, :2], torch.zeros(channels, 2)) and torch.equal(pool[2][:, 2], x[0])


def test_conv_update_negative_slots_are_padding(kernels: ModuleType) -> None:
    """state_in < 0 reads a zero window; state_out < 0 computes y but persists nothing."""
    gen = torch.Generator().manual_seed(6)
    batch, channels, kernel, slots = 2, 20, 4, 3
    x, pool, weight = _inputs(batch, channels, kernel, slots, torch.float32, gen, "cpu")
    before = pool.clone()
    state_in = torch.tensor([-1, 0])
    state_out = torch.tensor([-1, 2])
    y_ref, _ = _reference(x, pool, weight, state_in.clamp_min(0), state_out.clamp_min(0), state_in < 0)

    y = kernels.causal_conv1d_update_slots(
        x, pool, weight, state_in, state_out, torch.zeros(batch, dtype=torch.bool), block_c=16
    )

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool[:2], before[:2])
    assert torch.equal(pool[2][:, :2], before[0][:, 1:]) and torch.equal(pool[2][:, 2], x[1])


def test_conv_update_settled_loads_give_the_same_bits(kernels: ModuleType) -> None:
    """settled (old window and weights loaded before the PDL wait) and launch_next_early: the same y and
    pool, bit for bit, with a fresh row and padding slots."""
    gen = torch.Generator().manual_seed(8)
    batch, channels, kernel, slots = 4, 40, 4, 9
    x, pool, weight = _inputs(batch, channels, kernel, slots, torch.bfloat16, gen, "cpu")
    state_in = torch.tensor([3, -1, 5, 0])
    state_out = torch.tensor([3, -1, 6, 8])
    fresh = torch.tensor([False, False, True, False])
    results = []
    for flags in ({}, {"settled": True, "launch_next_early": True}):
        pool_copy = pool.clone()
        y = kernels.causal_conv1d_update_slots(
            x, pool_copy, weight, state_in, state_out, fresh, block_c=16, **flags
        )
        results.append((y, pool_copy))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_conv_update_rejects_bad_pool(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    x, pool, weight = _inputs(2, 8, 4, 3, torch.float32, gen, "cpu")
    slots = torch.tensor([0, 1])
    fresh = torch.zeros(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="conv_pool"):
        kernels.causal_conv1d_update_slots(x, pool.transpose(1, 2), weight, slots, slots, fresh)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("channels", [10240, 8192, 1000], ids=["27b", "35b-a3b", "odd-width"])
def test_conv_update_cuda_real_shapes(batch: int, channels: int) -> None:
    from ninfer.ops.triton.conv_update import causal_conv1d_update_slots

    gen = torch.Generator().manual_seed(batch * 100 + channels)
    kernel, slots = 4, 2 * batch + 5
    x, pool, weight = _inputs(batch, channels, kernel, slots, torch.bfloat16, gen, "cuda")
    perm = torch.randperm(slots, generator=gen)
    state_in = perm[:batch].clone()
    state_out = state_in.clone()
    state_out[1::2] = perm[batch : batch + len(state_out[1::2])]  # odd rows move to a free slot
    fresh = torch.zeros(batch, dtype=torch.bool)
    fresh[-1] = batch > 1  # one fresh row when there are several
    state_in, state_out, fresh = state_in.cuda(), state_out.cuda(), fresh.cuda()
    y_ref, pool_ref = _reference(x, pool, weight, state_in, state_out, fresh)
    out = torch.full((batch, channels), float("nan"), dtype=torch.bfloat16, device="cuda")

    y = causal_conv1d_update_slots(x, pool, weight, state_in, state_out, fresh, out=out)

    assert not y.isnan().any()
    assert max_rel_error(y, y_ref) < 1e-2
    mismatches = (y != y_ref).sum().item()  # same roundings: only fp32 sum-order noise may flip a bit
    assert mismatches <= y.numel() // 100, f"{mismatches} of {y.numel()} differ"
    assert torch.equal(pool, pool_ref), "written windows must be exact copies; other slots unchanged"


def _reference_tokens(
    x: torch.Tensor,
    pool: torch.Tensor,
    weight: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    fresh: torch.Tensor,
    tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T one-token reference steps per row (x [B*T, C]); the window after token t goes to state_out[:, t]
    (per position, [B, T]) or only the last one to state_out ([B])."""
    batch = state_in.shape[0]
    window = torch.where(fresh[:, None, None], 0, pool.index_select(0, state_in))
    xs = x.reshape(batch, tokens, -1)
    pool_after, ys = pool.clone(), []
    for t in range(tokens):
        y, window = causal_conv1d_update(xs[:, t], window, weight)
        ys.append(y)
        if state_out.dim() == 2:
            pool_after.index_copy_(0, state_out[:, t], window.to(pool.dtype))
    if state_out.dim() == 1:
        pool_after.index_copy_(0, state_out, window.to(pool.dtype))
    return torch.stack(ys, 1).reshape(batch * tokens, -1), pool_after


@pytest.mark.parametrize("tokens", [2, 3, 5])
@pytest.mark.parametrize("kernel", [4, 3])
@pytest.mark.parametrize("per_position", [True, False], ids=["per-position", "final-only"])
def test_conv_update_tokens_equal_single_token_steps(
    kernels: ModuleType, tokens: int, kernel: int, per_position: bool
) -> None:
    """T tokens per row in one launch = T reference steps: y for every token and the windows after every
    token (per position) or the last one (in place for one row), a fresh row, strided x."""
    gen = torch.Generator().manual_seed(17 * tokens + kernel + per_position)
    batch, channels, slots = 3, 40, 3 + 3 * tokens
    x, pool, weight = _inputs(batch * tokens, channels, kernel, slots, torch.float32, gen, "cpu")
    state_in = torch.tensor([2, 0, 1])
    fresh = torch.tensor([False, True, False])
    if per_position:
        state_out = torch.arange(3, 3 + batch * tokens).reshape(batch, tokens)
    else:
        state_out = torch.tensor([2, 4, 5])  # row 0 in place
    y_ref, pool_ref = _reference_tokens(x, pool, weight, state_in, state_out, fresh, tokens)
    out = torch.full((batch * tokens, channels), float("nan"))

    y = kernels.causal_conv1d_update_slots(
        x, pool, weight, state_in, state_out, fresh, tokens_per_row=tokens, out=out, block_c=16
    )

    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(pool, pool_ref), "windows are copies of inputs: exact; other slots unchanged"


def test_conv_update_tokens_reject_a_row_count_not_a_multiple(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(2)
    x, pool, weight = _inputs(5, 8, 4, 6, torch.float32, gen, "cpu")
    slots = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="multiple of tokens_per_row"):
        kernels.causal_conv1d_update_slots(
            x, pool, weight, slots, slots, torch.zeros(2, dtype=torch.bool), tokens_per_row=2
        )


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("tokens", [2, 4])
def test_conv_update_tokens_cuda_real_shapes(tokens: int) -> None:
    from ninfer.ops.triton.conv_update import causal_conv1d_update_slots

    gen = torch.Generator().manual_seed(tokens)
    batch, channels, kernel = 8, 10240, 4
    slots = batch * (tokens + 1)
    x, pool, weight = _inputs(batch * tokens, channels, kernel, slots, torch.bfloat16, gen, "cuda")
    state_in = torch.arange(batch, device="cuda")
    state_out = torch.arange(batch, batch * (tokens + 1), device="cuda").reshape(batch, tokens)
    fresh = torch.zeros(batch, dtype=torch.bool, device="cuda")
    y_ref, pool_ref = _reference_tokens(x, pool, weight, state_in, state_out, fresh, tokens)

    y = causal_conv1d_update_slots(x, pool, weight, state_in, state_out, fresh, tokens_per_row=tokens)

    assert max_rel_error(y, y_ref) < 1e-2
    assert torch.equal(pool, pool_ref)
