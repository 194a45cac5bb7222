"""Triton Gated DeltaNet decode/verify step over a state pool (fast path of the GDN recurrence).

Same maths as `ninfer.ops.gated_delta.gdn_gating` followed by `recurrent_gated_delta_rule` with
`use_qk_l2norm=True`, for B rows of T tokens each (T = 1 for decode, T > 1 for speculative verify):

    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    q, k <- l2norm(q, k) (eps 1e-6),  q <- q * dk^-0.5
    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

Value head j reads key head j // (nv / nk), so q and k are passed with their nk key heads, unrepeated.
The gating, the l2norm and the scale are computed in the kernel, so the projection outputs go straight
in. The state lives in the pool rec [S, nv, dk, dv] fp32: row r reads slot state_in[r] and writes slot
state_out[r] in place (they may be equal). One program owns one (row, value head, dv block) tile of the
state for all T tokens, so the state makes exactly one trip through registers per step.

The step is computed from the raw q and k and the old state, o = decay rq S^T q + rk rq (k . q) delta (rq, rk
the l2norm-and-scale factors, delta = beta (v - decay rk S^T k)): the same maths as normalising first and
reading the updated state, but its five reductions (|q|, |k|, S^T q, S^T k, k . q) are independent, so they
overlap instead of forming a chain of three: measured faster at one and eight rows (docs/benchmarks.md, "Why
the kernels are as they are", GDN). The results differ from the chained form by fp32 rounding only.

Padding rows (state_in[r] < 0) are skipped: their output is written as zeros and no state is touched.
A row with state_out[r] < 0 is computed but not persisted. Slots written by one row must not be read or
written by another row of the same call (the pool is updated in place, with no ordering between rows).

With `intermediate_states` [B, T, nv, dk, dv] fp32 the state after every position is written there and
the pool is left alone. With state_out [B, T] the state after position t is written to pool slot
state_out[r, t] instead: a speculative verify's per-position states, one of which the commit of the
accepted prefix makes the sequence's current slot (no copy).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["gdn_decode_step"]

_L2NORM_EPS = 1e-6


@triton.jit
def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    pool_ptr,
    state_in_ptr,
    state_out_ptr,
    fresh_ptr,
    scratch_ptr,
    o_ptr,
    num_tokens,
    q_stride_b,
    q_stride_t,
    q_stride_h,
    k_stride_b,
    k_stride_t,
    k_stride_h,
    v_stride_b,
    v_stride_t,
    v_stride_h,
    a_stride_b,
    a_stride_t,
    a_stride_h,
    b_stride_b,
    b_stride_t,
    b_stride_h,
    scale,
    eps,
    NV: tl.constexpr,
    GROUP: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    WRITE_SCRATCH: tl.constexpr,
    PER_POSITION: tl.constexpr,
    HAS_FRESH: tl.constexpr,
    SETTLED: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    if not SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    v_block = tl.program_id(2)
    key_head = head // GROUP

    offs_k = tl.arange(0, BLOCK_K)
    offs_v = v_block * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_state = mask_k[:, None] & mask_v[None, :]
    state_tile = offs_k[:, None] * DV + offs_v[None, :]  # within one head's [dk, dv] state

    o_row = o_ptr + row.to(tl.int64) * num_tokens * NV * DV + head * DV
    # the row's slots and fresh flag (step inputs: loaded at once, not after the recurrence), the state
    # tile (none for a padding row) and the gating parameters; with SETTLED before the wait
    slot_in = tl.load(state_in_ptr + row).to(tl.int64)
    if not PER_POSITION:  # per position, each position's slot is loaded where its state is stored
        slot_out = tl.load(state_out_ptr + row).to(tl.int64)
    if HAS_FRESH:
        is_fresh = tl.load(fresh_ptr + row) != 0
    state_ptrs = pool_ptr + (tl.maximum(slot_in, 0) * NV + head) * DK * DV + state_tile
    state = tl.load(state_ptrs, mask=mask_state & (slot_in >= 0), other=0.0)
    a_log = tl.load(a_log_ptr + head)
    dt_bias = tl.load(dt_bias_ptr + head)
    if SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    if slot_in < 0:  # padding row: zero output, no state traffic
        for t in range(num_tokens):
            tl.store(o_row + t * NV * DV + offs_v, tl.zeros([BLOCK_V], tl.float32), mask=mask_v)
    else:
        if HAS_FRESH:  # a sequence's first token starts from the zero state, whatever its slot holds
            state = tl.where(is_fresh, 0.0, state)
        decay_rate = tl.exp(a_log.to(tl.float32))
        dt_bias = dt_bias.to(tl.float32)
        for t in range(num_tokens):
            q = tl.load(
                q_ptr + row * q_stride_b + t * q_stride_t + key_head * q_stride_h + offs_k,
                mask=mask_k,
                other=0.0,
            ).to(tl.float32)
            k = tl.load(
                k_ptr + row * k_stride_b + t * k_stride_t + key_head * k_stride_h + offs_k,
                mask=mask_k,
                other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_ptr + row * v_stride_b + t * v_stride_t + head * v_stride_h + offs_v, mask=mask_v, other=0.0
            ).to(tl.float32)
            a = tl.load(a_ptr + row * a_stride_b + t * a_stride_t + head * a_stride_h).to(tl.float32)
            b = tl.load(b_ptr + row * b_stride_b + t * b_stride_t + head * b_stride_h).to(tl.float32)

            x = a + dt_bias
            # overflow-free softplus; equals torch's (linear above 20) to fp32 rounding for every x
            softplus = tl.maximum(x, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(x)))
            decay = tl.exp(-decay_rate * softplus)
            beta = tl.sigmoid(b)
            # Every reduction reads the raw q, k and the old state, so they run side by side instead of
            # one after another (see the module docstring): with q' = rq q, k' = rk k the l2-normed and
            # scaled vectors, S' = decay S + k' delta^T, delta = beta (v - decay S^T k'), o = S'^T q'.
            rq = scale / tl.sqrt(tl.sum(q * q, axis=0) + eps)
            rk = 1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps)
            state_k = tl.sum(state * k[:, None], axis=0)  # S^T k over this dv block
            state_q = tl.sum(state * q[:, None], axis=0)
            k_dot_q = tl.sum(k * q, axis=0)
            delta = (v - decay * rk * state_k) * beta
            state = state * decay + (k * rk)[:, None] * delta[None, :]
            o = decay * rq * state_q + (rk * rq * k_dot_q) * delta
            tl.store(o_row + t * NV * DV + offs_v, o, mask=mask_v)
            if WRITE_SCRATCH:
                scratch_head = ((row.to(tl.int64) * num_tokens + t) * NV + head) * DK * DV
                tl.store(scratch_ptr + scratch_head + state_tile, state, mask=mask_state)
            if PER_POSITION:  # the state after position t persists in that position's slot
                slot_t = tl.load(state_out_ptr + row * num_tokens + t).to(tl.int64)
                t_ptrs = pool_ptr + (tl.maximum(slot_t, 0) * NV + head) * DK * DV + state_tile
                tl.store(t_ptrs, state, mask=mask_state & (slot_t >= 0))
        if not WRITE_SCRATCH and not PER_POSITION:  # a negative slot_out: nothing persists
            out_ptrs = pool_ptr + (tl.maximum(slot_out, 0) * NV + head) * DK * DV + state_tile
            tl.store(out_ptrs, state, mask=mask_state & (slot_out >= 0))


def _with_tokens(x: torch.Tensor, per_token_dims: int) -> torch.Tensor:
    """View a [B, ...] input without a token dim as [B, 1, ...]; require a unit stride on the last dim."""
    if x.dim() == per_token_dims + 1:
        x = x.unsqueeze(1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x


def gdn_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    rec_pool: torch.Tensor,
    state_in: torch.Tensor,
    state_out: torch.Tensor,
    *,
    fresh: torch.Tensor | None = None,
    intermediate_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int = 4,
    settled: bool = False,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """GDN recurrence for B rows of T tokens, state updated in the pool by slot -> o fp32.

    q, k [B, T, nk, dk] (or [B, nk, dk] for T = 1), v [B, T, nv, dv] (or [B, nv, dv]), a, b [B, T, nv]
    (or [B, nv]) in any float dtype (strided views of the projection outputs are fine as long as the
    last dim is contiguous); A_log, dt_bias [nv]; rec_pool [S, nv, dk, dv] fp32 contiguous;
    state_in, state_out [B] integer slots (negative = padding / do not persist); state_out may be
    [B, T] instead: the state after each position persists in its own slot (a speculative verify's
    per-position states, selected at commit); `fresh` [B] bool: the row starts from the zero state
    instead of its slot's (a sequence's first token).
    Returns o [B, T, nv, dv] fp32 ([B, nv, dv] when q had no token dim); `out` may supply that buffer.
    With `intermediate_states` [B, T, nv, dk, dv] fp32 the per-position states go there, not the pool.
    `settled=True`: rec_pool, A_log, dt_bias, state_in, state_out and fresh are complete before this
    kernel can launch (bound weights; the pool written by an earlier step; the step's inputs; `pdl`), so
    the slots, the state tile and the gating parameters load before the programmatic-launch wait.
    `launch_next_early`: see `pdl`.
    """
    squeeze_tokens = q.dim() == 3
    q, k, v = _with_tokens(q, 2), _with_tokens(k, 2), _with_tokens(v, 2)
    a, b = _with_tokens(a, 1), _with_tokens(b, 1)
    batch, num_tokens, nk, dk = q.shape
    nv, dv = v.shape[2], v.shape[3]
    if k.shape != q.shape or v.shape[:2] != (batch, num_tokens) or a.shape != (batch, num_tokens, nv):
        raise ValueError(
            f"shape mismatch: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} a {tuple(a.shape)}"
        )
    if b.shape != a.shape or nv % nk != 0:
        raise ValueError(f"b {tuple(b.shape)} vs a {tuple(a.shape)}; nv={nv} must be a multiple of nk={nk}")
    if rec_pool.dtype != torch.float32 or not rec_pool.is_contiguous() or rec_pool.shape[1:] != (nv, dk, dv):
        raise ValueError(
            f"rec_pool must be contiguous fp32 [S, {nv}, {dk}, {dv}], got {tuple(rec_pool.shape)}"
        )

    per_position = state_out.dim() == 2
    if state_in.shape != (batch,) or state_out.shape not in ((batch,), (batch, num_tokens)):
        raise ValueError(
            f"state_in {tuple(state_in.shape)} must be [{batch}], state_out {tuple(state_out.shape)} "
            f"[{batch}] or [{batch}, {num_tokens}]"
        )
    if per_position and num_tokens == 1:  # one position: the final state, the decode step's own path
        state_out, per_position = state_out.reshape(batch), False
    if per_position and not state_out.is_contiguous():
        state_out = state_out.contiguous()
    if per_position and intermediate_states is not None:
        raise ValueError("per-position state_out slots and intermediate_states are two forms of one output")

    o_shape = (batch, num_tokens, nv, dv)
    if out is None:
        o = torch.empty(o_shape, dtype=torch.float32, device=q.device)
    else:
        o = out.view(o_shape)  # raises unless out is a contiguous buffer of the right size
        if out.dtype != torch.float32:
            raise ValueError("out must be fp32")
    if intermediate_states is not None:
        if (
            intermediate_states.shape != (batch, num_tokens, nv, dk, dv)
            or not intermediate_states.is_contiguous()
        ):
            raise ValueError(
                f"intermediate_states must be contiguous [{batch}, {num_tokens}, {nv}, {dk}, {dv}]"
            )
        if intermediate_states.dtype != torch.float32:
            raise ValueError("intermediate_states must be fp32")
    if batch == 0 or num_tokens == 0:
        return o[:, 0] if squeeze_tokens else o

    block_k = triton.next_power_of_2(dk)
    # 64 value columns per program from two rows (faster at eight rows: docs/benchmarks.md, GDN), 32 for one
    # row (more programs for its few heads)
    block_v = block_v or min(triton.next_power_of_2(dv), 64 if batch > 1 else 32)
    scratch = intermediate_states if intermediate_states is not None else rec_pool  # unused when not written
    grid = (batch, nv, triton.cdiv(dv, block_v))
    if schedule.recording:
        early = {  # before the wait when settled: the slots, the fresh flags, the state tile, the gating
            "state_in": state_in, "state_out": None if per_position else state_out, "fresh": fresh,
            "rec_pool": rec_pool, "A_log": A_log, "dt_bias": dt_bias,
        }  # fmt: skip
        states = {"intermediate_states": intermediate_states} if intermediate_states is not None else {}
        schedule.record(
            "gdn_decode._gdn_decode_kernel", launch_next_early=launch_next_early,
            early_reads=early if settled else {}, writes={"o": o, **(states or {"rec_pool": rec_pool})},
        )  # fmt: skip
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, rec_pool, state_in, state_out,
        fresh if fresh is not None else state_in, scratch, o,
        num_tokens,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2),
        dk**-0.5, _L2NORM_EPS,
        NV=nv, GROUP=nv // nk, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v,
        WRITE_SCRATCH=intermediate_states is not None, PER_POSITION=per_position, HAS_FRESH=fresh is not None,
        SETTLED=settled, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=num_warps,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return o[:, 0] if squeeze_tokens else o
