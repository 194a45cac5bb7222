"""The Gated DeltaNet layer's step ops over the state slot pools, reference and fast side by side: the
layer input's projection, the short conv, the gating and the delta rule, with each row's conv window and
recurrent state read from its slot and written back to its output slot.

- `gdn_decode` (every row has T tokens, `StepFacts.tokens_per_row`; graph-capturable): from the normed
  layer input x to (o, z). Reference: the input projection, gather the slots, T steps of
  `causal_conv1d_update`, gating and `recurrent_gated_delta_rule`, scatter (the state after each row's
  last token, or with state_out [B, T] after each of its tokens). Fast `fast_gdn_decode`: at 2..8 rows one
  token each, two launches: the stacked input projection with the conv step in its epilogue
  (`skinny_gemm.ConvStep`), then the recurrence (`ninfer.ops.triton.gdn_decode`); at one row, or without
  stacked rows, the projection, the conv step kernel (`ninfer.ops.triton.conv_update`) and the
  recurrence (the epilogue measured slower at one row; docs/benchmarks.md, "Why the kernels are as they
  are", GDN); with T > 1 the conv step and the recurrence walk the row's T tokens.
- `gdn_prefill` (rows of any length): per row `causal_conv1d` + `chunk_gated_delta_rule` (one-token rows
  take the step path). Fast `fast_gdn_prefill`: fla-core's varlen conv and chunked delta rule over all
  rows at once, with the chunk table made once per step (`fla_varlen`, kept in the step's memo).

Ops read all states before writing any (a row may write the slot another row reads). The fast forms take
their PDL flags from `ninfer.ops.pdl_policy`: the pools were written by an earlier step and the gating
parameters are bound, so the conv step, its epilogue form and the recurrence load them before their wait.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule
from ninfer.ops.linear import fast_linear
from ninfer.ops.pdl_policy import pdl_policy
from ninfer.ops.step import StepFacts

__all__ = [
    "CONV_EPILOGUE_ROWS",
    "FlaVarlen",
    "GdnHeads",
    "GdnWeights",
    "fast_gdn_decode",
    "fast_gdn_prefill",
    "fla_varlen",
    "gdn_decode",
    "gdn_prefill",
    "in_projection",
    "split_conv_output",
    "split_heads",
]

Tensor = torch.Tensor
Linear = Callable[[Tensor, Tensor], Tensor]

# rows (one token each) at which the fast decode runs the conv step in the stacked input GEMV's epilogue:
# faster than projection + conv kernel at eight rows, slower at one, where the one-row GEMV's thousands of
# 2-column programs each pay the conv's scattered loads and stores (docs/benchmarks.md, "Why the kernels
# are as they are", GDN)
CONV_EPILOGUE_ROWS = range(2, 9)


@dataclass(frozen=True)
class GdnHeads:
    """The head layout of a GDN layer: nk key heads of dk, nv value heads of dv (nv a multiple of nk)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True, eq=False)
class GdnWeights:
    """The weights a GDN step reads. in_proj_qkv rows are [q(key_dim) | k(key_dim) | v(value_dim)]."""

    in_proj_qkv: Tensor  # [conv_dim, H]
    in_proj_z: Tensor  # [value_dim, H]
    in_proj_b: Tensor  # [nv, H]
    in_proj_a: Tensor  # [nv, H]
    conv_weight: Tensor  # [conv_dim, K]
    A_log: Tensor  # [nv] fp32
    dt_bias: Tensor  # [nv] fp32
    in_proj: Tensor | None = None  # [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a] when stacked (one GEMM)


def _in_proj_sizes(w: GdnWeights) -> list[int]:
    return [w.in_proj_qkv.shape[0], w.in_proj_z.shape[0], w.in_proj_b.shape[0], w.in_proj_a.shape[0]]


def in_projection(w: GdnWeights, x: Tensor, linear: Linear) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> mixed_qkv [N, conv_dim] (to be convolved), z [N, value_dim], a [N, nv], b [N, nv]."""
    if w.in_proj is not None:  # one GEMM for the four projections (stacked [qkv; z; b; a])
        mixed_qkv, z, b, a = linear(x, w.in_proj).split(_in_proj_sizes(w), dim=-1)
        return mixed_qkv, z, a, b
    return linear(x, w.in_proj_qkv), linear(x, w.in_proj_z), linear(x, w.in_proj_a), linear(x, w.in_proj_b)


def split_conv_output(heads: GdnHeads, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nk, dk], v [..., nv, dv] (views, key heads unrepeated)."""
    q, k, v = conv_out.split([heads.key_dim, heads.key_dim, heads.value_dim], dim=-1)
    nk, nv = heads.num_key_heads, heads.num_value_heads
    return (
        q.unflatten(-1, (nk, heads.key_head_dim)),
        k.unflatten(-1, (nk, heads.key_head_dim)),
        v.unflatten(-1, (nv, heads.value_head_dim)),
    )


def split_heads(heads: GdnHeads, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nv, dk], v [..., nv, dv] (the reference ops' layout).

    Key heads are repeated so that value head j reads key head j // (nv / nk).
    """
    q, k, v = split_conv_output(heads, conv_out)
    group = heads.num_value_heads // heads.num_key_heads
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2), v


def _gathered_states(step: StepFacts, conv_slots: Tensor, rec_slots: Tensor) -> tuple[Tensor, Tensor]:
    """Every row's starting state, read before any write (a row may write the slot another row reads)."""
    keep = ~step.fresh
    conv_in = torch.where(keep[:, None, None], conv_slots.index_select(0, step.state_in), 0)
    rec_in = torch.where(keep[:, None, None, None], rec_slots.index_select(0, step.state_in), 0)
    return conv_in, rec_in


def _rows_step(
    w: GdnWeights, heads: GdnHeads, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_in: Tensor, rec_in: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row, all rows at once -> (o [B, nv, dv] fp32, conv state, recurrent state)."""
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    conv_out, conv_state = causal_conv1d_update(mixed_qkv, conv_in, w.conv_weight)
    q, k, v = split_heads(heads, conv_out.unsqueeze(1))  # [B, T=1, nv, d]
    o, rec_state = recurrent_gated_delta_rule(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), rec_in)
    return o[:, 0], conv_state, rec_state


def gdn_decode(
    w: GdnWeights, heads: GdnHeads, x: Tensor, conv_slots: Tensor, rec_slots: Tensor, step: StepFacts
) -> tuple[Tensor, Tensor]:
    """x [N, H] the normed layer input, N = B * T row-major -> (o [N, nv, dv] fp32, z [N, value_dim]): T
    one-token steps over all rows at once (the states carried between them); the state after each row's
    last token (state_out [B]) or after each of its tokens (state_out [B, T]) written to its slots."""
    mixed_qkv, z, a, b = in_projection(w, x, F.linear)
    conv, rec = _gathered_states(step, conv_slots, rec_slots)
    tokens, rows = step.tokens_per_row or 1, step.num_rows
    if tokens == 1:
        o, conv, rec = _rows_step(w, heads, mixed_qkv, a, b, conv, rec)
        conv_slots.index_copy_(0, step.state_out.reshape(rows), conv.to(conv_slots.dtype))
        rec_slots.index_copy_(0, step.state_out.reshape(rows), rec)
        return o, z
    per_position = step.state_out.dim() == 2
    mixed_qkv, a, b = (t.unflatten(0, (rows, tokens)) for t in (mixed_qkv, a, b))
    outputs = []
    for t in range(tokens):
        o, conv, rec = _rows_step(w, heads, mixed_qkv[:, t], a[:, t], b[:, t], conv, rec)
        outputs.append(o)
        if per_position:
            conv_slots.index_copy_(0, step.state_out[:, t], conv.to(conv_slots.dtype))
            rec_slots.index_copy_(0, step.state_out[:, t], rec)
    if not per_position:
        conv_slots.index_copy_(0, step.state_out, conv.to(conv_slots.dtype))
        rec_slots.index_copy_(0, step.state_out, rec)
    return torch.stack(outputs, 1).flatten(0, 1), z


def fast_gdn_decode(
    w: GdnWeights, heads: GdnHeads, x: Tensor, conv_slots: Tensor, rec_slots: Tensor, step: StepFacts
) -> tuple[Tensor, Tensor]:
    """`gdn_decode`, updating the pools in place. At 2..8 rows of one token and with stacked rows, two
    launches: the stacked input projection (our GEMV, whether or not `prefers_skinny` would take it) with
    the conv step over the slots in its epilogue, then the recurrence. One row, more than 8, or no stacked
    rows: the projection (`fast_linear`), the conv step kernel, the recurrence. T > 1 tokens per row (a
    verify or forced span): the projection, the conv over T tokens, the recurrence over T."""
    from ninfer.ops.triton.conv_update import causal_conv1d_update_slots
    from ninfer.ops.triton.gdn_decode import gdn_decode_step
    from ninfer.ops.triton.skinny_gemm import ConvStep, skinny_linear

    tokens = step.tokens_per_row or 1
    policy = pdl_policy(x.shape[0], tokens)
    if tokens > 1:
        mixed_qkv, z, a, b = in_projection(w, x, fast_linear)
        conv_out = causal_conv1d_update_slots(
            mixed_qkv, conv_slots, w.conv_weight, step.state_in, step.state_out, step.fresh,
            tokens_per_row=tokens, settled=policy.settled, launch_next_early=policy.launch_next_early,
        )  # fmt: skip
        rows = step.num_rows
        q, k, v = (t.unflatten(0, (rows, tokens)) for t in split_conv_output(heads, conv_out))
        o = gdn_decode_step(
            q, k, v, a.unflatten(0, (rows, tokens)), b.unflatten(0, (rows, tokens)), w.A_log, w.dt_bias,
            rec_slots, step.state_in, step.state_out, fresh=step.fresh, settled=policy.settled,
            launch_next_early=policy.launch_next_early,
        )  # fmt: skip
        return o.flatten(0, 1), z
    if w.in_proj is not None and x.shape[0] in CONV_EPILOGUE_ROWS and x.dtype == w.in_proj.dtype:
        conv = ConvStep(
            pool=conv_slots, weight=w.conv_weight, state_in=step.state_in, state_out=step.state_out,
            fresh=step.fresh, settled=policy.settled,
        )  # fmt: skip
        conv_out, z, b, a = skinny_linear(x, w.in_proj, conv=conv).split(_in_proj_sizes(w), dim=-1)
    else:
        mixed_qkv, z, a, b = in_projection(w, x, fast_linear)
        conv_out = causal_conv1d_update_slots(
            mixed_qkv, conv_slots, w.conv_weight, step.state_in, step.state_out, step.fresh,
            settled=policy.settled, launch_next_early=policy.launch_next_early,
        )  # fmt: skip
    q, k, v = split_conv_output(heads, conv_out)
    o = gdn_decode_step(
        q, k, v, a, b, w.A_log, w.dt_bias, rec_slots, step.state_in, step.state_out, fresh=step.fresh,
        settled=policy.settled, launch_next_early=policy.launch_next_early,
    )  # fmt: skip
    return o, z


def gdn_prefill(
    w: GdnWeights, heads: GdnHeads, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_slots: Tensor,
    rec_slots: Tensor, step: StepFacts,
) -> Tensor:  # fmt: skip
    """Rows of any length (their projections given) -> o [N, nv, dv] fp32: per row causal conv + chunked
    delta rule (one-token rows take the step path); each row's final state written to its slot."""
    if step.padded:
        raise ValueError("a padded step (a prefill graph's capacity) runs the fast GDN prefill only")
    conv_in, rec_in = _gathered_states(step, conv_slots, rec_slots)
    bounds = step.query_bounds()
    outputs, conv_states, rec_states = [], [], []
    for row in range(step.num_rows):
        start, end = bounds[row], bounds[row + 1]
        if end - start < 1:
            raise ValueError(f"row {row} has no tokens (query_start {bounds})")
        rows, tokens = slice(row, row + 1), slice(start, end)
        if end - start == 1:
            o, conv_state, rec_state = _rows_step(
                w, heads, mixed_qkv[tokens], a[tokens], b[tokens], conv_in[rows], rec_in[rows]
            )
        else:
            g, beta = gdn_gating(a[tokens], b[tokens], w.A_log, w.dt_bias)
            conv_out, conv_state = causal_conv1d(mixed_qkv[tokens], w.conv_weight, conv_in[row])
            q, k, v = split_heads(heads, conv_out)  # [T, nv, d]
            o, rec_state = chunk_gated_delta_rule(q, k, v, g, beta, rec_in[row])
            conv_state, rec_state = conv_state.unsqueeze(0), rec_state.unsqueeze(0)
        outputs.append(o)
        conv_states.append(conv_state)
        rec_states.append(rec_state)
    conv_slots.index_copy_(0, step.state_out, torch.cat(conv_states).to(conv_slots.dtype))
    rec_slots.index_copy_(0, step.state_out, torch.cat(rec_states))
    return torch.cat(outputs)


# the chunk length of fla's varlen chunked delta rule (passed to it) and conv (fixed at 64 inside fla)
_FLA_CHUNK = 64
_FLA_VARLEN = "ninfer.ops.gdn.fla_varlen"  # its key in the step's memo


@dataclass(frozen=True, eq=False)
class FlaVarlen:
    """fla's varlen metadata of one step, made once for all its GDN layers."""

    bounds: tuple[int, ...]  # the host row bounds it was made from
    cu_seqlens_cpu: Tensor
    chunk_indices: Tensor  # [chunks, 2] (row, chunk within the row), on the device


def fla_varlen(step: StepFacts) -> FlaVarlen:
    """The step's chunk table, from the host row bounds, copied without draining the GPU queue (pinned),
    made by the step's first GDN layer and kept in its memo for the others.

    fla builds it itself when not given one, from a host copy that we would have to rebuild per layer,
    and reads it back to the device from pageable memory: a full host sync in every GDN layer.
    """
    bounds = tuple(step.query_bounds())
    cached = step.memo.get(_FLA_VARLEN)
    if isinstance(cached, FlaVarlen) and cached.bounds == bounds:
        return cached
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    chunks = [(row, i) for row, length in enumerate(lengths) for i in range(-(-length // _FLA_CHUNK))]
    device, dtype = step.query_start.device, step.query_start.dtype
    table = torch.tensor(chunks, dtype=dtype).view(-1, 2)
    if device.type == "cuda":
        table = table.pin_memory()
    meta = FlaVarlen(
        bounds=bounds,
        cu_seqlens_cpu=torch.tensor(bounds, dtype=dtype),
        chunk_indices=table.to(device, non_blocking=True),
    )
    step.memo[_FLA_VARLEN] = meta
    return meta


def fast_gdn_prefill(
    w: GdnWeights, heads: GdnHeads, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_slots: Tensor,
    rec_slots: Tensor, step: StepFacts,
) -> Tensor:  # fmt: skip
    """fla-core varlen conv and chunked delta rule over all rows at once (gating and l2norm in-kernel).

    Returns o in the model dtype (fla's output; the gated norm casts to it first anyway). A padded step
    (a prefill graph's capacity) gives fla the real bounds on the device and the capacity's chunk table:
    the chunks past the bound are empty, the final states are the last real token's, and the padding's
    output rows are zeros."""
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    conv_in, rec_in = _gathered_states(step, conv_slots, rec_slots)
    cu_seqlens = step.query_start
    varlen = fla_varlen(step)
    # fla keeps a conv window of the kernel's full width K (its first column unused here); ours holds K-1
    conv_out, conv_final = fla_causal_conv1d(
        mixed_qkv.contiguous().unsqueeze(0),
        w.conv_weight,
        initial_state=F.pad(conv_in, (1, 0)),
        output_final_state=True,
        activation="silu",
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=varlen.cu_seqlens_cpu,
        chunk_indices=varlen.chunk_indices,
    )
    q, k, v = split_conv_output(heads, conv_out)  # [1, N, heads, d]
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    o, rec_final = fla_chunk_gated_delta_rule(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        initial_state=rec_in,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
        chunk_size=_FLA_CHUNK,
        cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=varlen.cu_seqlens_cpu,
        chunk_indices=varlen.chunk_indices,
    )
    conv_slots.index_copy_(0, step.state_out, conv_final[..., 1:].to(conv_slots.dtype))
    rec_slots.index_copy_(0, step.state_out, rec_final.float())
    if step.padded:  # fla writes no output row past the device bound: the padding's stays as allocated
        pad = torch.arange(o.shape[1], device=o.device) >= step.query_start[-1]
        o[0].masked_fill_(pad[:, None, None], 0)
    return o[0]
