"""The op implementations one Program runs, chosen once at its construction: reference or fast.

`forward` (model.py) calls every semantically closed op through a `Kernels` table instead of importing
it, so the same model code runs the plain-PyTorch reference (`REFERENCE`: CPU, tests, the oracle) or
the fast GPU ops (`fast_kernels()`: Triton kernels in `ninfer.ops.triton`, fla-core's chunked delta rule
and conv for prefill, SDPA for prefill attention). Each fast op equals its reference op on the same
inputs (tests/ops, `gpu` tests); `forward` does not know which table it runs.

The GDN entries take a whole layer's step because their fast forms fuse what the reference does in
several ops (gather the state slots, conv, gating, l2norm, recurrence, scatter) into one or two
launches that update the state pool in place.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ninfer.ops.attention import gated_attention_output, kv_write, paged_attention, split_q_gate
from ninfer.ops.attention import paged_decode_attention as reference_decode_attention
from ninfer.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule
from ninfer.ops.mlp import swiglu
from ninfer.ops.moe import moe_block, moe_block_from_projections
from ninfer.ops.norm import gated_rms_norm, rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin

if TYPE_CHECKING:
    from ninfer.targets.qwen3_6.model import StepBatch
    from ninfer.targets.qwen3_6.variant import Variant
    from ninfer.targets.qwen3_6.view import GdnLayerView, MoeMlpView

Tensor = torch.Tensor

__all__ = [
    "Kernels",
    "REFERENCE",
    "fast_kernels",
    "gdn_in_projection",
    "gdn_split_heads",
    "kernels_name",
    "qkv_heads",
    "select_kernels",
    "split_conv_output",
]


# (w, variant, mixed_qkv [N, conv_dim], a [N, nv], b [N, nv], conv_slots, rec_slots, batch)
# -> o [N, nv, dv] in fp32 or the model dtype (the gated norm casts it to the model dtype first)
GdnStep = Callable[["GdnLayerView", "Variant", Tensor, Tensor, Tensor, Tensor, Tensor, "StepBatch"], Tensor]
# (w, variant, x [N, H] the normed layer input, conv_slots, rec_slots, batch) -> (o [N, nv, dv] as GdnStep's,
# z [N, value_dim]): the input projection, conv steps and recurrence of batch.tokens_per_row tokens per row
# (N = B * T, row-major), the state after each row's last token (T = 1, or state_out [B]) or after each of
# its tokens (state_out [B, T]) written to its slots
GdnDecode = Callable[["GdnLayerView", "Variant", Tensor, Tensor, Tensor, "StepBatch"], tuple[Tensor, Tensor]]


@dataclass(frozen=True)
class Kernels:
    """One implementation per op; `name` says which table (logged, shown by bench).

    What the fast table assumes of its callers (the model's forward keeps it): norm weights and projection
    weights are bound weights, never written; the residual given to `add_rms_norm` / `linear_add_rms_norm`
    was written three or more launches earlier (an earlier block's norm: four in the forward); and the
    kernel launched after a norm, the gated norm, the attention prologue, decode attention, the output
    gate, the conv step, the recurrence or the decode MoE block reads nothing before its own PDL wait but
    bound weights, earlier steps' state and such a residual (at one row these let it launch before their
    own wait, `ninfer.ops.triton.pdl`).
    """

    name: str
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    gated_rms_norm: Callable[[Tensor, Tensor, Tensor, float], Tensor]
    swiglu: Callable[[Tensor, Tensor], Tensor]  # (gate, up) -> silu(gate) * up
    gdn_decode: GdnDecode  # T tokens per row (batch.tokens_per_row): graph-capturable
    gdn_prefill: GdnStep  # rows of any length
    # (q [N, nH, D], k_pages, v_pages, block_table [N, maxp], context_lens [N], scale, qkv, tokens_per_row)
    # -> the gated output [N, nH*D] (`attention_output_gate` of the attention's [N, nH, D], its gate read
    # from qkv): one query per table row, each seeing its context_lens positions; the step wrote the last
    # tokens_per_row positions of each row's run of queries: graph-capturable
    gated_decode_attention: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor, int], Tensor]
    # (q [N, nH, D], k_pages, v_pages, batch, scale) -> [N, nH, D]: rows, pages and lengths from the batch
    prefill_attention: Callable[[Tensor, Tensor, Tensor, StepBatch, float], Tensor]
    # (qkv [N, nH*2D + 2*nKV*D], q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping, variant)
    # -> q [N, nH, D] normed and roped; k normed and roped, and v, written into their KV slots
    attention_prologue: Callable[
        [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Variant], Tensor
    ]
    # (o [N, nH, D], qkv, variant) -> o * sigmoid(gate) [N, nH*D], the gate read from qkv's q columns
    # (prefill; a decode step gates inside `gated_decode_attention`)
    attention_output_gate: Callable[[Tensor, Tensor, Variant], Tensor]
    # (w, variant, x [N, H], decode) -> [N, H] in x's dtype: the whole sparse MoE block (routing, routed
    # experts, sigmoid-gated shared expert); decode: a few tokens inside a CUDA graph (static, no sync)
    moe_block: Callable[[MoeMlpView, Variant, Tensor, bool], Tensor]
    # (x [M, K], w [N, K]) -> x @ w.T: every dense projection
    linear: Callable[[Tensor, Tensor], Tensor]
    # (act [M, K], w [N, K], residual [M, N], weight, eps) -> add_rms_norm(act @ w.T, residual, weight, eps):
    # a block's output projection with the residual add and the next norm
    linear_add_rms_norm: Callable[[Tensor, Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    # (positions [3, N], rotary_dim, theta, mrope_section) -> (cos, sin) [N, rotary_dim] fp32
    mrope_cos_sin: Callable[[Tensor, int, float, tuple[int, int, int]], tuple[Tensor, Tensor]]
    # (x [M, H], lm_head [V, H]) -> (x @ lm_head.T in x's dtype).float(): the logits
    logits: Callable[[Tensor, Tensor], Tensor]
    # (logits [B, V], out [B] int64 or None) -> torch.argmax(logits, -1) (into out where given): the first
    # max, a NaN counting as the largest
    argmax: Callable[[Tensor, Tensor | None], Tensor]


# ---- reference compositions ---------------------------------------------------------------------


def _reference_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def _reference_logits(x: Tensor, lm_head: Tensor) -> Tensor:
    return F.linear(x, lm_head).float()


def _reference_argmax(logits: Tensor, out: Tensor | None = None) -> Tensor:
    return torch.argmax(logits, dim=-1, out=out)


def _reference_linear_add_rms_norm(
    act: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    return _reference_add_rms_norm(F.linear(act, w), residual, weight, eps)


def qkv_heads(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, variant: Variant
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """qkv [N, nH*2D + 2*nKV*D] -> q [N, nH, D] (normed, roped), gate [N, nH*D], k [N, nKV, D] (normed,
    roped), v [N, nKV, D]: the reference composition (differentiable)."""
    n, heads, d, eps = qkv.shape[0], variant.num_attention_heads, variant.head_dim, variant.rms_norm_eps
    q_out, k, v = qkv.split([variant.q_proj_dim, variant.kv_dim, variant.kv_dim], -1)
    q, gate = split_q_gate(q_out, heads, d)
    q = apply_partial_rope(rms_norm(q, q_norm, eps), cos, sin)
    k = apply_partial_rope(rms_norm(k.reshape(n, variant.num_kv_heads, d), k_norm, eps), cos, sin)
    return q, gate, k, v.reshape(n, variant.num_kv_heads, d)


def _reference_attention_prologue(
    qkv: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    slot_mapping: Tensor,
    variant: Variant,
) -> Tensor:
    q, _, k, v = qkv_heads(qkv, q_norm, k_norm, cos, sin, variant)
    kv_write(k_pages, v_pages, k, v, slot_mapping)
    return q


def _reference_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, batch: StepBatch, scale: float
) -> Tensor:
    return paged_attention(
        q, k_pages, v_pages, batch.block_table, batch.query_start, batch.context_lens, scale
    )


def _gated(o: Tensor, qkv: Tensor) -> Tensor:
    """o [N, nH, D] times sigmoid of its gate columns in qkv (the interleaved q projection comes first)."""
    _, heads, dim = o.shape
    return gated_attention_output(o, split_q_gate(qkv[:, : heads * 2 * dim], heads, dim)[1])


def _reference_attention_output_gate(o: Tensor, qkv: Tensor, variant: Variant) -> Tensor:
    return _gated(o, qkv)


def _reference_gated_decode_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, context_lens: Tensor, scale: float,
    qkv: Tensor, tokens_per_row: int,
) -> Tensor:  # fmt: skip
    return _gated(reference_decode_attention(q, k_pages, v_pages, block_table, context_lens, scale), qkv)


def _reference_moe_block(w: MoeMlpView, variant: Variant, x: Tensor, decode: bool) -> Tensor:
    """HF `Qwen3_5MoeSparseMoeBlock` (`ops.moe`), its input projections one GEMM when stacked."""
    num_experts, shared = w.router.shape[0], w.shared_gate_proj.shape[0]
    if w.input_proj is None:
        return moe_block(
            x, w.router, w.gate_up, w.down, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj,
            w.shared_expert_gate, variant.num_experts_per_tok, decode,
        )  # fmt: skip
    router_logits, gate, up = F.linear(x, w.input_proj).split([num_experts, shared, shared], dim=-1)
    return moe_block_from_projections(
        x, router_logits, gate, up, w.gate_up, w.down, w.shared_down_proj, w.shared_expert_gate,
        variant.num_experts_per_tok, decode,
    )  # fmt: skip


def gdn_in_projection(
    w: GdnLayerView, x: Tensor, linear: Callable[[Tensor, Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> mixed_qkv [N, conv_dim] (to be convolved), z [N, value_dim], a [N, nv], b [N, nv]."""
    if w.in_proj is not None:  # one GEMM for the four projections (stacked [qkv; z; b; a])
        mixed_qkv, z, b, a = linear(x, w.in_proj).split(_in_proj_sizes(w), dim=-1)
        return mixed_qkv, z, a, b
    return linear(x, w.in_proj_qkv), linear(x, w.in_proj_z), linear(x, w.in_proj_a), linear(x, w.in_proj_b)


def _in_proj_sizes(w: GdnLayerView) -> list[int]:
    return [w.in_proj_qkv.shape[0], w.in_proj_z.shape[0], w.in_proj_b.shape[0], w.in_proj_a.shape[0]]


def split_conv_output(variant: Variant, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nk, dk], v [..., nv, dv] (views, key heads unrepeated)."""
    key_dim = variant.linear_key_dim
    q, k, v = conv_out.split([key_dim, key_dim, variant.linear_value_dim], dim=-1)
    nk, nv = variant.linear_num_key_heads, variant.linear_num_value_heads
    return (
        q.unflatten(-1, (nk, variant.linear_key_head_dim)),
        k.unflatten(-1, (nk, variant.linear_key_head_dim)),
        v.unflatten(-1, (nv, variant.linear_value_head_dim)),
    )


def gdn_split_heads(variant: Variant, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nv, dk], v [..., nv, dv] (the reference ops' layout).

    Key heads are repeated so that value head j reads key head j // (nv / nk).
    """
    q, k, v = split_conv_output(variant, conv_out)
    group = variant.linear_num_value_heads // variant.linear_num_key_heads
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2), v


def _gathered_states(batch: StepBatch, conv_slots: Tensor, rec_slots: Tensor) -> tuple[Tensor, Tensor]:
    """Every row's starting state, read before any write (a row may write the slot another row reads)."""
    keep = ~batch.fresh
    conv_in = torch.where(keep[:, None, None], conv_slots.index_select(0, batch.state_in), 0)
    rec_in = torch.where(keep[:, None, None, None], rec_slots.index_select(0, batch.state_in), 0)
    return conv_in, rec_in


def _reference_gdn_rows(
    w: GdnLayerView,
    variant: Variant,
    mixed_qkv: Tensor,
    a: Tensor,
    b: Tensor,
    conv_in: Tensor,
    rec_in: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row, all rows at once -> (o [B, nv, dv] fp32, conv state, recurrent state)."""
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    conv_out, conv_state = causal_conv1d_update(mixed_qkv, conv_in, w.conv_weight)
    q, k, v = gdn_split_heads(variant, conv_out.unsqueeze(1))  # [B, T=1, nv, d]
    o, rec_state = recurrent_gated_delta_rule(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), rec_in)
    return o[:, 0], conv_state, rec_state


def _reference_gdn_decode(
    w: GdnLayerView, variant: Variant, x: Tensor, conv_slots: Tensor, rec_slots: Tensor, batch: StepBatch
) -> tuple[Tensor, Tensor]:
    """T tokens per row as T one-token steps over all rows at once (the states carried between them)."""
    mixed_qkv, z, a, b = gdn_in_projection(w, x, F.linear)
    conv, rec = _gathered_states(batch, conv_slots, rec_slots)
    tokens, rows = batch.tokens_per_row or 1, batch.num_rows
    if tokens == 1:
        o, conv, rec = _reference_gdn_rows(w, variant, mixed_qkv, a, b, conv, rec)
        conv_slots.index_copy_(0, batch.state_out.reshape(rows), conv.to(conv_slots.dtype))
        rec_slots.index_copy_(0, batch.state_out.reshape(rows), rec)
        return o, z
    per_position = batch.state_out.dim() == 2
    mixed_qkv, a, b = (t.unflatten(0, (rows, tokens)) for t in (mixed_qkv, a, b))
    outputs = []
    for t in range(tokens):
        o, conv, rec = _reference_gdn_rows(w, variant, mixed_qkv[:, t], a[:, t], b[:, t], conv, rec)
        outputs.append(o)
        if per_position:
            conv_slots.index_copy_(0, batch.state_out[:, t], conv.to(conv_slots.dtype))
            rec_slots.index_copy_(0, batch.state_out[:, t], rec)
    if not per_position:
        conv_slots.index_copy_(0, batch.state_out, conv.to(conv_slots.dtype))
        rec_slots.index_copy_(0, batch.state_out, rec)
    return torch.stack(outputs, 1).flatten(0, 1), z


def _reference_gdn_prefill(
    w: GdnLayerView,
    variant: Variant,
    mixed_qkv: Tensor,
    a: Tensor,
    b: Tensor,
    conv_slots: Tensor,
    rec_slots: Tensor,
    batch: StepBatch,
) -> Tensor:
    """Per row: causal conv + chunked delta rule (one-token rows take the step path)."""
    conv_in, rec_in = _gathered_states(batch, conv_slots, rec_slots)
    bounds = batch.query_bounds()
    outputs, conv_states, rec_states = [], [], []
    for row in range(batch.num_rows):
        start, end = bounds[row], bounds[row + 1]
        if end - start < 1:
            raise ValueError(f"row {row} has no tokens (query_start {bounds})")
        rows, tokens = slice(row, row + 1), slice(start, end)
        if end - start == 1:
            o, conv_state, rec_state = _reference_gdn_rows(
                w, variant, mixed_qkv[tokens], a[tokens], b[tokens], conv_in[rows], rec_in[rows]
            )
        else:
            g, beta = gdn_gating(a[tokens], b[tokens], w.A_log, w.dt_bias)
            conv_out, conv_state = causal_conv1d(mixed_qkv[tokens], w.conv_weight, conv_in[row])
            q, k, v = gdn_split_heads(variant, conv_out)  # [T, nv, d]
            o, rec_state = chunk_gated_delta_rule(q, k, v, g, beta, rec_in[row])
            conv_state, rec_state = conv_state.unsqueeze(0), rec_state.unsqueeze(0)
        outputs.append(o)
        conv_states.append(conv_state)
        rec_states.append(rec_state)
    conv_slots.index_copy_(0, batch.state_out, torch.cat(conv_states).to(conv_slots.dtype))
    rec_slots.index_copy_(0, batch.state_out, torch.cat(rec_states))
    return torch.cat(outputs)


REFERENCE = Kernels(
    name="reference",
    rms_norm=rms_norm,
    add_rms_norm=_reference_add_rms_norm,
    gated_rms_norm=gated_rms_norm,
    swiglu=swiglu,
    gdn_decode=_reference_gdn_decode,
    gdn_prefill=_reference_gdn_prefill,
    gated_decode_attention=_reference_gated_decode_attention,
    prefill_attention=_reference_prefill_attention,
    attention_prologue=_reference_attention_prologue,
    attention_output_gate=_reference_attention_output_gate,
    moe_block=_reference_moe_block,
    linear=F.linear,
    linear_add_rms_norm=_reference_linear_add_rms_norm,
    mrope_cos_sin=mrope_cos_sin,
    logits=_reference_logits,
    argmax=_reference_argmax,
)


# ---- fast compositions (CUDA) -------------------------------------------------------------------


# rows for which the GDN input projection runs our GEMV with the conv step in its epilogue. H200 graph
# replay, same process (`tools.ab_step --env`, 2026-11-30), fused against projection + conv kernel:
# B = 8 27B 14.886 vs 14.946 ms, 35B-A3B 5.969 vs 6.010 ms (there the fused GEMV also replaces cuBLAS);
# B = 1 slower, 27B 13.205 vs 13.057 ms, 35B-A3B 2.391 vs 2.372 ms (the one-row GEMV's 2-column programs,
# thousands of them, each paying the conv's scattered loads and stores), so one row keeps the conv kernel.
_CONV_EPILOGUE_ROWS = range(2, 9)


def _launches_next_early(rows: int) -> bool:
    """Whether a small decode kernel lets the next one launch before its own wait (`pdl`): at one row, where
    the chains it starts end in GEMVs that load their weights before their wait (H200 graph
    replay, one process, `tools.ab_step`, 2026-11-30: 35B-A3B B = 1 2.212 -> 2.150 ms for the norms, the
    gates, the conv step and the recurrence, with those GEMVs loading whole row slices; 2.152 -> 2.128 for
    the attention prologue, attention and merge and the MoE down launch; 27B unchanged). At eight rows it
    cost 0.23 ms per 35B-A3B step. Every kernel that follows one of these reads nothing before its wait but
    bound weights, earlier steps' state and K/V, the step's inputs (slots, lengths, block tables, fresh
    flags: copied and unpacked at the step's start) and the residual stream (written by a norm four or more
    launches earlier, complete before the kernel ahead of it started)."""
    return rows == 1


def _fast_gdn_decode(
    w: GdnLayerView, variant: Variant, x: Tensor, conv_slots: Tensor, rec_slots: Tensor, batch: StepBatch
) -> tuple[Tensor, Tensor]:
    """Two launches, both updating the pools in place: the stacked input projection (our GEMV) with the
    conv step over the slots in its epilogue, then the recurrence, at 2..8 rows. That GEMV replaces cuBLAS
    there whether or not `prefers_skinny` would (35B-A3B's (8, 12352, 2048) runs the untuned dot tile,
    unsplit: the A/B above is with it). One row, more than 8, or no stacked rows: the projection
    (`_fast_linear`), the conv step kernel, the recurrence. The pools and the bound weights are settled
    (no kernel of this step wrote them before), so the conv step and the recurrence load them before their
    PDL wait: 35B-A3B B = 1 2.294 -> 2.281 / 2.283 ms each (H200, `tools.ab_step`, 2026-11-30)."""
    from ninfer.ops.triton.conv_update import causal_conv1d_update_slots
    from ninfer.ops.triton.gdn_decode import gdn_decode_step
    from ninfer.ops.triton.skinny_gemm import ConvStep, skinny_linear

    tokens = batch.tokens_per_row or 1
    if tokens > 1:  # a verify or forced span: projection, the conv over T tokens, the recurrence over T
        mixed_qkv, z, a, b = gdn_in_projection(w, x, _fast_linear)
        conv_out = causal_conv1d_update_slots(
            mixed_qkv, conv_slots, w.conv_weight, batch.state_in, batch.state_out, batch.fresh,
            tokens_per_row=tokens, settled=True,
        )  # fmt: skip
        q, k, v = (t.unflatten(0, (batch.num_rows, tokens)) for t in split_conv_output(variant, conv_out))
        o = gdn_decode_step(
            q, k, v, a.unflatten(0, (batch.num_rows, tokens)), b.unflatten(0, (batch.num_rows, tokens)),
            w.A_log, w.dt_bias, rec_slots, batch.state_in, batch.state_out, fresh=batch.fresh, settled=True,
        )  # fmt: skip
        return o.flatten(0, 1), z
    if w.in_proj is not None and x.shape[0] in _CONV_EPILOGUE_ROWS and x.dtype == w.in_proj.dtype:
        conv = ConvStep(
            pool=conv_slots, weight=w.conv_weight, state_in=batch.state_in, state_out=batch.state_out,
            fresh=batch.fresh, settled=True,
        )  # fmt: skip
        conv_out, z, b, a = skinny_linear(x, w.in_proj, conv=conv).split(_in_proj_sizes(w), dim=-1)
    else:
        mixed_qkv, z, a, b = gdn_in_projection(w, x, _fast_linear)
        conv_out = causal_conv1d_update_slots(
            mixed_qkv, conv_slots, w.conv_weight, batch.state_in, batch.state_out, batch.fresh,
            settled=True, launch_next_early=_launches_next_early(x.shape[0]),
        )  # fmt: skip
    q, k, v = split_conv_output(variant, conv_out)
    o = gdn_decode_step(
        q, k, v, a, b, w.A_log, w.dt_bias, rec_slots, batch.state_in, batch.state_out, fresh=batch.fresh,
        settled=True, launch_next_early=_launches_next_early(x.shape[0]),
    )  # fmt: skip
    return o, z


# the chunk length of fla's varlen chunked delta rule (passed to it) and conv (fixed at 64 inside fla)
_FLA_CHUNK = 64


@dataclass(frozen=True, eq=False)
class _FlaVarlen:
    """fla's varlen metadata of one step, built once for all its GDN layers."""

    query_start: Tensor  # the batch's own device tensor and its host bounds: the key this was built for
    bounds: tuple[int, ...]
    cu_seqlens_cpu: Tensor
    chunk_indices: Tensor  # [chunks, 2] (row, chunk within the row), on the device


_last_fla_varlen: list[_FlaVarlen] = []


def _fla_varlen(batch: StepBatch) -> _FlaVarlen:
    """The step's chunk table, from the host row bounds, copied without draining the GPU queue (pinned).

    fla builds it itself when not given one, from a host copy that we would have to rebuild per layer,
    and reads it back to the device from pageable memory: a full host sync in every GDN layer.
    """
    bounds = batch.query_bounds()
    cached = _last_fla_varlen[0] if _last_fla_varlen else None  # one read: another Program may swap it
    if cached is not None and cached.query_start is batch.query_start and cached.bounds == tuple(bounds):
        return cached
    lengths = [end - start for start, end in zip(bounds, bounds[1:])]
    chunks = [(row, i) for row, length in enumerate(lengths) for i in range(-(-length // _FLA_CHUNK))]
    device = batch.query_start.device
    table = torch.tensor(chunks, dtype=batch.query_start.dtype).view(-1, 2)
    if device.type == "cuda":
        table = table.pin_memory()
    meta = _FlaVarlen(
        query_start=batch.query_start,
        bounds=tuple(bounds),
        cu_seqlens_cpu=torch.tensor(bounds, dtype=batch.query_start.dtype),
        chunk_indices=table.to(device, non_blocking=True),
    )
    _last_fla_varlen[:] = [meta]
    return meta


def _fast_gdn_prefill(
    w: GdnLayerView,
    variant: Variant,
    mixed_qkv: Tensor,
    a: Tensor,
    b: Tensor,
    conv_slots: Tensor,
    rec_slots: Tensor,
    batch: StepBatch,
) -> Tensor:
    """fla-core varlen conv and chunked delta rule over all rows at once (gating and l2norm in-kernel).

    Returns o in the model dtype (fla's output; the gated norm casts to it first anyway)."""
    from fla.modules.convolution import causal_conv1d as fla_causal_conv1d
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    conv_in, rec_in = _gathered_states(batch, conv_slots, rec_slots)
    cu_seqlens = batch.query_start
    varlen = _fla_varlen(batch)
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
    q, k, v = split_conv_output(variant, conv_out)  # [1, N, heads, d]
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
    conv_slots.index_copy_(0, batch.state_out, conv_final[..., 1:].to(conv_slots.dtype))
    rec_slots.index_copy_(0, batch.state_out, rec_final.float())
    return o[0]


def _sdpa_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, batch: StepBatch, scale: float
) -> Tensor:
    """Per row: gather the row's K/V pages, then one SDPA call (flash) with bottom-right causal masking.

    Row bounds and lengths come from the batch's host copies (no device read-back)."""
    from torch.nn.attention.bias import causal_lower_right

    page_size, n_kv = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // n_kv
    block_table = batch.block_table
    out = torch.empty_like(q)
    starts, lengths = batch.query_bounds(), batch.context_lengths()
    for row, context_len in enumerate(lengths):
        q_row = q[starts[row] : starts[row + 1]]
        n_queries = q_row.shape[0]
        if n_queries == 0:
            continue
        pages = block_table[row, : -(-context_len // page_size)].long()
        k = k_pages[pages].flatten(0, 1)[:context_len].repeat_interleave(group, dim=1)  # [L, nH, D]
        v = v_pages[pages].flatten(0, 1)[:context_len].repeat_interleave(group, dim=1)
        mask = causal_lower_right(n_queries, context_len) if n_queries < context_len else None
        o = F.scaled_dot_product_attention(
            q_row.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
        )
        out[starts[row] : starts[row + 1]] = o[0].transpose(0, 1)
    return out


def _fast_attention_prologue(
    qkv: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    slot_mapping: Tensor,
    variant: Variant,
) -> Tensor:
    from ninfer.ops.triton.attention_prologue import qk_norm_rope_kv_write

    return qk_norm_rope_kv_write(
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping,
        num_heads=variant.num_attention_heads, num_kv_heads=variant.num_kv_heads,
        head_dim=variant.head_dim, eps=variant.rms_norm_eps, settled=True,
        launch_next_early=_launches_next_early(qkv.shape[0]),
    )  # fmt: skip


def _fast_gated_decode_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, context_lens: Tensor, scale: float,
    qkv: Tensor, tokens_per_row: int,
) -> Tensor:  # fmt: skip
    """The output gate applied where the attention's output is written (the merge of the split-KV
    partials, or the single-split kernel): one dependent launch fewer per attention layer than attention
    + `sigmoid_gate`. Its early loads (``settled``) assume the step wrote only each query's newest
    position, so a step of several tokens per row loads nothing before its wait."""
    from ninfer.ops.triton.paged_decode_attention import paged_decode_attention

    o = paged_decode_attention(
        q, k_pages, v_pages, block_table, context_lens, scale,
        launch_next_early=_launches_next_early(q.shape[0]), gate_qkv=qkv, settled=tokens_per_row == 1,
    )  # fmt: skip
    return o.flatten(1)


def _fast_attention_output_gate(o: Tensor, qkv: Tensor, variant: Variant) -> Tensor:
    from ninfer.ops.triton.attention_prologue import sigmoid_gate

    return sigmoid_gate(
        o, qkv, num_heads=variant.num_attention_heads, head_dim=variant.head_dim,
        launch_next_early=_launches_next_early(o.shape[0]),
    )  # fmt: skip


def _fast_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    from ninfer.ops.triton.norm import rms_norm as triton_rms_norm

    return triton_rms_norm(x, weight, eps, settled=True, launch_next_early=_launches_next_early(x.shape[0]))


def _fast_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual stream was written by an earlier block's norm, four launches back in the forward, and
    the norm weight is bound: both load before the PDL wait (`norm`, ``settled``)."""
    from ninfer.ops.triton.norm import add_rms_norm

    return add_rms_norm(
        x, residual, weight, eps, settled=True, launch_next_early=_launches_next_early(x.shape[0])
    )


def _fast_gated_rms_norm(x: Tensor, weight: Tensor, z: Tensor, eps: float) -> Tensor:
    from ninfer.ops.triton.norm import gated_rms_norm as triton_gated_rms_norm

    return triton_gated_rms_norm(x, weight, z, eps, launch_next_early=_launches_next_early(x.shape[0]))


def _fast_moe_block(w: MoeMlpView, variant: Variant, x: Tensor, decode: bool) -> Tensor:
    """Decode (up to DECODE_MAX_PAIRS token x expert pairs, stacked input rows, a shared expert as wide as
    the routed ones): the stacked input GEMV (router logits and the shared expert's gate and up), then
    `moe_decode_block`'s two launches (the routing inside the experts' gate/up launch; down + weighted
    combine). Otherwise: the router GEMM, the routing kernel, then `fused_moe` with the shared expert as one
    more weighted slot (a wider shared expert takes its sorted path)."""
    from ninfer.ops.triton.fused_moe import DECODE_MAX_PAIRS, SharedExpert, default_config, fused_moe
    from ninfer.ops.triton.moe_decode import moe_decode_block
    from ninfer.ops.triton.moe_routing import moe_route_topk

    num_experts, top_k = w.router.shape[0], variant.num_experts_per_tok
    same_width = w.shared_down_proj.shape[1] == w.gate_up.shape[1] // 2
    decode_sized = decode and x.shape[0] * top_k <= DECODE_MAX_PAIRS
    if decode_sized and w.input_proj is not None and same_width:
        projected = _fast_linear(x, w.input_proj)
        return moe_decode_block(
            x, projected, w.gate_up, w.down, w.shared_down_proj, w.shared_expert_gate, top_k,
            launch_next_early=_launches_next_early(x.shape[0]),
        )  # fmt: skip
    if w.input_proj is not None:  # rows [router; shared gate; shared up]: the shared gate_up is a slice
        router, shared_gate_up = w.input_proj[:num_experts], w.input_proj[num_experts:]
    else:
        router, shared_gate_up = w.router.to(x.dtype), torch.cat([w.shared_gate_proj, w.shared_up_proj])
    bound_router = w.input_proj is not None or w.router.dtype == x.dtype  # else a cast made just before
    weights, expert_ids, shared_weight = moe_route_topk(
        _fast_linear(x, router, static_weight=bound_router),
        top_k,
        x=x,
        shared_expert_gate=w.shared_expert_gate,
    )
    assert shared_weight is not None
    shared = SharedExpert(gate_up=shared_gate_up, down=w.shared_down_proj, weight=shared_weight)
    # fused_moe's decode path runs the shared expert as one more slot of equal width; a wider one takes
    # the sorted path, which computes it apart
    config = None if same_width else default_config(weights.numel())
    return fused_moe(x, w.gate_up, w.down, weights, expert_ids, shared=shared, config=config)


def _takes_skinny(x: Tensor, w: Tensor) -> bool:
    """Whether a decode projection streams the weight with our GEMV kernel: where it reads it faster than
    cuBLAS on the H200 (every one-row shape, some 2..8-row ones: `skinny_gemm.prefers_skinny`)."""
    if x.dim() != 2 or x.dtype != w.dtype or w.stride(-1) != 1:
        return False
    from ninfer.ops.triton.skinny_gemm import prefers_skinny

    return prefers_skinny(x.shape[0], w.shape[0], w.shape[1])


def _fast_linear(x: Tensor, w: Tensor, *, static_weight: bool = True) -> Tensor:
    """Our GEMV where `_takes_skinny`, cuBLAS otherwise. static_weight: w is a bound weight, never written
    (the GEMV may read it before its PDL wait); False for a tensor an earlier kernel computes."""
    if _takes_skinny(x, w):
        from ninfer.ops.triton.skinny_gemm import skinny_linear

        return skinny_linear(x, w, static_weight=static_weight)
    return F.linear(x, w)


def _fast_logits(x: Tensor, lm_head: Tensor) -> Tensor:
    """The logits in one launch where our GEMV takes the projection (it writes the x-dtype result widened
    to fp32; the reference's `.float()` was a launch of its own at the end of every decode step: 2.9 us at
    B = 1, 6.8 at B = 8 on the H200), cuBLAS + the cast otherwise."""
    if _takes_skinny(x, lm_head):
        from ninfer.ops.triton.skinny_gemm import skinny_linear

        out = torch.empty((x.shape[0], lm_head.shape[0]), dtype=torch.float32, device=x.device)
        return skinny_linear(x, lm_head, out=out, static_weight=True)
    return F.linear(x, lm_head).float()


def _fast_linear_add_rms_norm(
    act: Tensor, w: Tensor, residual: Tensor, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """The projection, then the fused add + norm: two launches. A split-K GEMV (35B-A3B's eight-row
    attn_o / gdn_out, 27B's eight-row mlp_down) leaves its fp32 partials to the norm kernel, which sums
    them in the reduce launch's order: the same residual stream, one dependent launch fewer (H200 graph
    replay, one process, `tools.ab_step`, 2026-11-30: 27B B = 8 15.184 -> 15.092 ms, 35B-A3B 5.982 ->
    5.954). The one-launch form for one row (the GEMV's last program doing the add and the norm;
    `ops/triton/gemv_norm.py` in commit 27fd6a4) measured 0.3 ms slower per 27B decode step than two
    launches under programmatic dependent launch."""
    from ninfer.ops.triton.norm import add_rms_norm_partials

    if _takes_skinny(act, w):
        from ninfer.ops.triton.skinny_gemm import skinny_linear_partials

        return add_rms_norm_partials(
            skinny_linear_partials(act, w, static_weight=True), residual, weight, eps, settled=True,
            launch_next_early=_launches_next_early(act.shape[0]),
        )  # fmt: skip
    return _fast_add_rms_norm(F.linear(act, w), residual, weight, eps)  # `_takes_skinny` said cuBLAS


def fast_kernels() -> Kernels:
    """The CUDA table: every op that has a fast implementation takes it (imports Triton and fla-core)."""
    from ninfer.ops.triton.activation import swiglu as triton_swiglu
    from ninfer.ops.triton.argmax import argmax_rows
    from ninfer.ops.triton.rope import mrope_cos_sin as triton_mrope_cos_sin

    gdn_prefill = _fast_gdn_prefill
    try:  # the `gpu` extra; without it prefill keeps the reference delta rule (correct, slower)
        import fla  # noqa: F401
    except ImportError:
        warnings.warn(
            "fla-core is not installed (pip install 'ninfer[gpu]'): GDN prefill runs the reference op",
            stacklevel=2,
        )
        gdn_prefill = _reference_gdn_prefill
    return replace(
        REFERENCE,
        name="fast",
        rms_norm=_fast_rms_norm,
        add_rms_norm=_fast_add_rms_norm,
        gated_rms_norm=_fast_gated_rms_norm,
        swiglu=triton_swiglu,
        gdn_decode=_fast_gdn_decode,
        gdn_prefill=gdn_prefill,
        gated_decode_attention=_fast_gated_decode_attention,
        prefill_attention=_sdpa_prefill_attention,
        attention_prologue=_fast_attention_prologue,
        attention_output_gate=_fast_attention_output_gate,
        moe_block=_fast_moe_block,
        linear=_fast_linear,
        linear_add_rms_norm=_fast_linear_add_rms_norm,
        mrope_cos_sin=triton_mrope_cos_sin,
        logits=_fast_logits,
        argmax=argmax_rows,
    )


def kernels_name(device: torch.device, requested: str = "auto") -> str:
    """Which table ``requested`` means on ``device`` (`ninfer.targets.open.resolve_kernels`)."""
    from ninfer.targets.open import resolve_kernels

    return resolve_kernels(device, requested)


def select_kernels(device: torch.device, requested: str = "auto") -> Kernels:
    """The table `kernels_name` names, built once per Program."""
    return REFERENCE if kernels_name(device, requested) == "reference" else fast_kernels()
