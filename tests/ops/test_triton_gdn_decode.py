"""Triton GDN decode step (`ninfer.ops.triton.gdn_decode`) against the reference gating + recurrence.

CPU tests run the kernel in the Triton interpreter through a private copy of the module (the
TRITON_INTERPRET variable is set only while that copy is loaded and run, so it does not leak into other
test modules). `gpu` tests run the compiled kernel at the 27B shapes.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.gated_delta import gdn_gating, recurrent_gated_delta_rule

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.gdn_decode")


def _inputs(
    batch: int, tokens: int, nk: int, nv: int, dk: int, dv: int, slots: int, gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Projection-like inputs; q/k/v are strided views of one mixed tensor, as the conv output is split."""
    mixed = torch.randn(batch, tokens, 2 * nk * dk + nv * dv, generator=gen)
    q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
    a = torch.randn(batch, tokens, nv, generator=gen) * 2.0
    a[0, 0, 0] = 25.0  # where torch.softplus turns linear (threshold 20): the kernel must agree
    return {
        "q": q.unflatten(-1, (nk, dk)),
        "k": k.unflatten(-1, (nk, dk)),
        "v": v.unflatten(-1, (nv, dv)),
        "a": a,
        "b": torch.randn(batch, tokens, nv, generator=gen) * 2.0,
        "A_log": torch.randn(nv, generator=gen) * 0.5,
        "dt_bias": torch.randn(nv, generator=gen),
        "pool": torch.randn(slots, nv, dk, dv, generator=gen) * 0.5,
    }


def _reference(
    x: dict[str, torch.Tensor], rows: list[int], state_in: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Live rows: (o [R, T, nv, dv], final state [R, nv, dk, dv], all states [R, T, nv, dk, dv]), fp32."""
    group = x["v"].shape[2] // x["q"].shape[2]
    q = x["q"][rows].float().repeat_interleave(group, dim=2)
    k = x["k"][rows].float().repeat_interleave(group, dim=2)
    g, beta = gdn_gating(x["a"][rows], x["b"][rows], x["A_log"], x["dt_bias"])
    initial = x["pool"].float()[state_in[rows].long()]
    o, final, states = recurrent_gated_delta_rule(
        q, k, x["v"][rows].float(), g, beta, initial, return_all_states=True
    )
    return o, final, states


CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("in_place", [False, True], ids=["distinct-slots", "in-place"])
@pytest.mark.parametrize("block_v", [None, 8], ids=["one-v-block", "v-blocks"])
def test_gdn_decode_updates_pool_like_reference(
    kernels: ModuleType, tokens: int, in_place: bool, block_v: int | None
) -> None:
    gen = torch.Generator().manual_seed(10 * tokens + in_place)
    batch, nk, nv, dk, dv, slots = 3, 2, 6, 16, 16, 7
    x = _inputs(batch, tokens, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([4, -1, 1], dtype=torch.int32)  # row 1 is padding
    state_out = state_in.clone() if in_place else torch.tensor([2, -1, 6], dtype=torch.int32)
    live = [0, 2]
    o_ref, final_ref, _ = _reference(x, live, state_in)
    pool_before = x["pool"].clone()
    out = torch.full((batch, tokens, nv, dv), float("nan"))

    o = kernels.gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_out,
        out=out, block_v=block_v,
    )  # fmt: skip

    assert o.data_ptr() == out.data_ptr()
    torch.testing.assert_close(o[live], o_ref, **CLOSE)
    assert torch.equal(o[1], torch.zeros_like(o[1])), "padding row output must be zeros"
    written = state_out[live].long()
    torch.testing.assert_close(x["pool"][written], final_ref, **CLOSE)
    untouched = [s for s in range(slots) if s not in written.tolist()]
    assert torch.equal(x["pool"][untouched], pool_before[untouched]), "only state_out slots may change"


@pytest.mark.parametrize("in_place", [False, True], ids=["distinct-slots", "in-place"])
def test_gdn_decode_settled_loads_give_the_same_bits(kernels: ModuleType, in_place: bool) -> None:
    """settled (state tile and gating parameters loaded before the PDL wait, a padding row loading none)
    and launch_next_early: the same outputs and pool, bit for bit, fresh and padding rows included."""
    gen = torch.Generator().manual_seed(40 + in_place)
    batch, nk, nv, dk, dv, slots = 4, 2, 6, 16, 16, 9
    x = _inputs(batch, 1, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([4, -1, 1, 7], dtype=torch.int32)  # row 1 is padding
    state_out = state_in.clone() if in_place else torch.tensor([2, -1, 6, 8], dtype=torch.int32)
    fresh = torch.tensor([False, False, True, False])
    results = []
    for flags in ({}, {"settled": True, "launch_next_early": True}):
        pool = x["pool"].clone()
        o = kernels.gdn_decode_step(
            x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], pool, state_in, state_out,
            fresh=fresh, block_v=8, **flags,
        )  # fmt: skip
        results.append((o, pool))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_gdn_decode_without_token_dim_and_odd_head_dims(kernels: ModuleType) -> None:
    """[B, nk, dk] inputs (T = 1 implied), dk and dv not powers of two, dv split over blocks, group 3."""
    gen = torch.Generator().manual_seed(3)
    batch, nk, nv, dk, dv, slots = 5, 2, 6, 12, 20, 10
    x = _inputs(batch, 1, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    state_out = torch.tensor([5, 6, -1, 8, 9], dtype=torch.int32)  # row 2 computed but not persisted
    rows = list(range(batch))
    o_ref, final_ref, _ = _reference(x, rows, state_in)
    pool_before = x["pool"].clone()
    out = torch.full((batch, nv, dv), float("nan"))

    o = kernels.gdn_decode_step(
        x["q"][:, 0], x["k"][:, 0], x["v"][:, 0], x["a"][:, 0], x["b"][:, 0], x["A_log"], x["dt_bias"],
        x["pool"], state_in, state_out, out=out, block_v=8,
    )  # fmt: skip

    assert o.shape == (batch, nv, dv)
    torch.testing.assert_close(o, o_ref[:, 0], **CLOSE)
    persisted = [0, 1, 3, 4]
    torch.testing.assert_close(x["pool"][state_out[persisted].long()], final_ref[persisted], **CLOSE)
    assert torch.equal(x["pool"][:5], pool_before[:5]) and torch.equal(x["pool"][7], pool_before[7])


def test_gdn_decode_fresh_rows_start_from_zero_state(kernels: ModuleType) -> None:
    """A fresh row (a sequence's first token) ignores whatever its slot holds, even NaN."""
    gen = torch.Generator().manual_seed(11)
    batch, nk, nv, dk, dv, slots = 3, 2, 4, 16, 16, 6
    x = _inputs(batch, 1, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([0, 1, 2], dtype=torch.int64)
    state_out = torch.tensor([3, 4, 5], dtype=torch.int64)
    fresh = torch.tensor([False, True, False])
    x["pool"][1] = float("nan")  # a stale slot: must not be read
    zeroed = dict(x, pool=torch.where(fresh[:, None, None, None], 0.0, x["pool"][state_in]))
    o_ref, final_ref, _ = _reference(zeroed, [0, 1, 2], torch.arange(batch))

    o = kernels.gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_out,
        fresh=fresh,
    )  # fmt: skip

    assert not o.isnan().any()
    torch.testing.assert_close(o, o_ref, **CLOSE)
    torch.testing.assert_close(x["pool"][3:], final_ref, **CLOSE)


def test_gdn_decode_intermediate_states_leave_pool_alone(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(7)
    batch, tokens, nk, nv, dk, dv, slots = 3, 3, 2, 6, 16, 16, 5
    x = _inputs(batch, tokens, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([3, 0, -1], dtype=torch.int32)  # row 2 is padding
    live = [0, 1]
    o_ref, _, states_ref = _reference(x, live, state_in)
    pool_before = x["pool"].clone()
    scratch = torch.full((batch, tokens, nv, dk, dv), float("nan"))
    out = torch.full((batch, tokens, nv, dv), float("nan"))

    o = kernels.gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_in,
        intermediate_states=scratch, out=out,
    )  # fmt: skip

    torch.testing.assert_close(o[live], o_ref, **CLOSE)
    assert torch.equal(o[2], torch.zeros_like(o[2]))
    torch.testing.assert_close(scratch[live], states_ref, **CLOSE)
    assert torch.isnan(scratch[2]).all(), "a padding row writes no scratch state"
    assert torch.equal(x["pool"], pool_before), "with a scratch buffer the pool is read only"


@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_gdn_decode_per_position_slots_hold_every_state(kernels: ModuleType, tokens: int) -> None:
    """state_out [B, T]: the state after position t lands in slot state_out[r, t] (a verify's per-position
    states), equal to the reference's state after that token; a padding row and a negative position slot
    persist nothing, no other slot changes, a fresh row starts from zero."""
    gen = torch.Generator().manual_seed(70 + tokens)
    batch, nk, nv, dk, dv = 3, 2, 6, 16, 16
    slots = 3 + batch * tokens
    x = _inputs(batch, tokens, nk, nv, dk, dv, slots, gen)
    state_in = torch.tensor([1, -1, 2], dtype=torch.int32)  # row 1 is padding
    state_out = torch.arange(3, 3 + batch * tokens, dtype=torch.int32).reshape(batch, tokens)
    state_out[2, 0] = -1  # row 2 keeps no state for its first position
    fresh = torch.tensor([False, False, True])
    x["pool"][2] = float("nan")  # the fresh row's slot must not be read
    live = [0, 2]
    starts = x["pool"].clone()
    starts[2] = 0.0
    x_ref = dict(x, pool=starts)
    o_ref, _, states_ref = _reference(x_ref, live, state_in)
    pool_before = x["pool"].clone()

    o = kernels.gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_out,
        fresh=fresh, block_v=8,
    )  # fmt: skip

    torch.testing.assert_close(o[live], o_ref, **CLOSE)
    assert torch.equal(o[1], torch.zeros_like(o[1]))
    written = []
    for i, row in enumerate(live):
        for t in range(tokens):
            slot = int(state_out[row, t])
            if slot < 0:
                continue
            written.append(slot)
            torch.testing.assert_close(x["pool"][slot], states_ref[i, t], **CLOSE)
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(x["pool"][untouched].nan_to_num(), pool_before[untouched].nan_to_num())


def test_gdn_decode_rejects_bad_pool(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    x = _inputs(2, 1, 1, 2, 8, 8, 3, gen)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="rec_pool"):
        kernels.gdn_decode_step(
            x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"].double(), slots, slots
        )


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gdn_decode_cuda_27b_shapes(batch: int, tokens: int, dtype: torch.dtype) -> None:
    from ninfer.ops.triton.gdn_decode import gdn_decode_step

    gen = torch.Generator().manual_seed(batch * 10 + tokens)
    nk, nv, dk, dv, slots = 16, 48, 128, 128, 2 * batch + 3
    x = {name: t.to("cuda") for name, t in _inputs(batch, tokens, nk, nv, dk, dv, slots, gen).items()}
    for name in ("q", "k", "v", "a", "b"):
        x[name] = x[name].to(dtype)  # the reference reads the same (rounded) values in fp32
    state_in = torch.randperm(slots, generator=gen)[:batch].to(torch.int32)
    if batch > 1:
        state_in[1] = -1  # a padding row
    live = [r for r in range(batch) if state_in[r] >= 0]
    state_in = state_in.cuda()
    o_ref, final_ref, states_ref = _reference(x, live, state_in)
    close = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else CLOSE

    out = torch.full((batch, tokens, nv, dv), float("nan"), device="cuda")
    pool_before = x["pool"].clone()
    gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_in,
        out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[live], o_ref, **close)
    torch.testing.assert_close(x["pool"][state_in[live].long()], final_ref, **close)
    assert not out.isnan().any()

    x["pool"].copy_(pool_before)
    scratch = torch.full((batch, tokens, nv, dk, dv), float("nan"), device="cuda")
    out.fill_(float("nan"))
    gdn_decode_step(
        x["q"], x["k"], x["v"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["pool"], state_in, state_in,
        intermediate_states=scratch, out=out,
    )  # fmt: skip
    torch.testing.assert_close(out[live], o_ref, **close)
    torch.testing.assert_close(scratch[live], states_ref, **close)
    assert torch.equal(x["pool"], pool_before)
