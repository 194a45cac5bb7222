"""The op implementations one Program runs, chosen once at its construction: reference or fast.

`forward` (model.py) calls every semantically closed op through a `Kernels` table instead of importing
it, so the same model code runs the plain-PyTorch reference (`REFERENCE`: CPU, tests, the oracle) or
the fast GPU ops (`fast_kernels()`). Both tables are names for ops that live in `ninfer.ops`, where each
op's reference and fast forms sit side by side (`ninfer.ops.norm`, `linear`, `attention`, `gdn`, `moe`,
`rope`, `mlp`, `sampling`) and where the fast forms decide their device dispatch and their PDL flags
(`ninfer.ops.pdl_policy`). This module only maps the family's views and `Variant` onto the ops' plain
tensors and parameter objects (`GdnWeights`, `GdnHeads`, `AttentionHeads`, `MoeMlpWeights`); the
`StepBatch` is passed as the ops' `StepFacts`. Each fast op equals its reference op on the same inputs
(tests/ops, `gpu` tests); `forward` does not know which table it runs.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ninfer.ops import attention, gdn, linear, moe, norm
from ninfer.ops.mlp import swiglu
from ninfer.ops.rope import mrope_cos_sin, vision_qkv_rotary
from ninfer.ops.sampling import argmax_rows

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
Prologue = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "Variant"], Tensor]


@dataclass(frozen=True)
class Kernels:
    """One implementation per op; `name` says which table (logged, shown by bench).

    What the fast table assumes of its callers (the model's forward keeps it): norm weights and projection
    weights are bound weights, never written; the residual given to `add_rms_norm` / `linear_add_rms_norm`
    was written three or more launches earlier (an earlier block's norm: four in the forward); and the
    kernel launched after a norm, the gated norm, the attention prologue, decode attention, the output
    gate, the conv step, the recurrence or the decode MoE block reads nothing before its own PDL wait but
    bound weights, earlier steps' state and such a residual (at one row these let it launch before their
    own wait, `ninfer.ops.triton.pdl`; the flags come from `ninfer.ops.pdl_policy`, and
    `ninfer.ops.triton.pdl.checked_schedule` checks a recorded step against these assumptions).
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
    # -> the gated output [N, nH*D] (o * sigmoid(gate) of the attention's [N, nH, D] o, its gate read
    # from qkv): one query per table row, each seeing its context_lens positions; the step wrote the last
    # tokens_per_row positions of each row's run of queries: graph-capturable
    gated_decode_attention: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, float, Tensor, int], Tensor]
    # (q [N, nH, D], k_pages, v_pages, batch, scale, qkv) -> the gated output [N, nH*D], its gate read from
    # qkv's q columns: rows of any length, pages and lengths from the batch (a padded batch's padding
    # tokens read as zeros); the fast form is graph-capturable (no host facts)
    gated_prefill_attention: Callable[[Tensor, Tensor, Tensor, StepBatch, float, Tensor], Tensor]
    # a DFlash drafter's (q [B*T, nH, D], k_pages, v_pages, block_table [B, maxp], context_lens [B], scale,
    # causal=, window=) -> [B*T, nH, D]: each row's T queries are the last T of its context
    # (`ninfer.ops.attention.paged_block_attention`); the fast form reads nothing back to the host
    block_attention: Callable[..., Tensor]
    # (qkv [N, nH*2D + 2*nKV*D], q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping, variant)
    # -> q [N, nH, D] normed and roped; k normed and roped, and v, written into their KV slots
    attention_prologue: Callable[
        [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Variant], Tensor
    ]
    # (w, variant, x [N, H], decode) -> [N, H] in x's dtype: the whole sparse MoE block (routing, routed
    # experts, sigmoid-gated shared expert); decode: a few tokens inside a CUDA graph (static, no sync)
    moe_block: Callable[[MoeMlpView, Variant, Tensor, bool], Tensor]
    # the vision tower's (qkv [n, 3, heads, D], cos, sin [n, D]) -> q, k, v contiguous [heads, n, D], q and
    # k rotated in fp32 (`ninfer.ops.rope.vision_qkv_rotary`)
    vision_qkv_rotary: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
    # the vision blocks' (x [M, K], fc1 [N, K], bias [N]) -> gelu(x @ fc1.T + bias, approximate="tanh")
    linear_gelu_tanh: Callable[[Tensor, Tensor, Tensor], Tensor]
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


# ---- the family's views and dims as the ops' parameters ------------------------------------------


def _attention_heads(variant: Variant) -> attention.AttentionHeads:
    return attention.AttentionHeads(
        variant.num_attention_heads, variant.num_kv_heads, variant.head_dim, variant.rms_norm_eps
    )


def _gdn_heads(variant: Variant) -> gdn.GdnHeads:
    return gdn.GdnHeads(
        variant.linear_num_key_heads, variant.linear_num_value_heads, variant.linear_key_head_dim,
        variant.linear_value_head_dim,
    )  # fmt: skip


def _gdn_weights(w: GdnLayerView) -> gdn.GdnWeights:
    return gdn.GdnWeights(
        w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a, w.conv_weight, w.A_log, w.dt_bias, w.in_proj
    )


def _moe_weights(w: MoeMlpView) -> moe.MoeMlpWeights:
    return moe.MoeMlpWeights(
        w.router, w.gate_up, w.down, w.shared_gate_proj, w.shared_up_proj, w.shared_down_proj,
        w.shared_expert_gate, w.input_proj,
    )  # fmt: skip


def qkv_heads(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, variant: Variant
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`ninfer.ops.attention.qkv_heads` with the variant's heads (the reference composition)."""
    return attention.qkv_heads(qkv, q_norm, k_norm, cos, sin, _attention_heads(variant))


def gdn_in_projection(
    w: GdnLayerView, x: Tensor, linear_op: Callable[[Tensor, Tensor], Tensor]
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> mixed_qkv [N, conv_dim] (to be convolved), z [N, value_dim], a [N, nv], b [N, nv]."""
    return gdn.in_projection(_gdn_weights(w), x, linear_op)


def split_conv_output(variant: Variant, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nk, dk], v [..., nv, dv] (views, key heads unrepeated)."""
    return gdn.split_conv_output(_gdn_heads(variant), conv_out)


def gdn_split_heads(variant: Variant, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nv, dk] (key heads repeated), v [..., nv, dv]."""
    return gdn.split_heads(_gdn_heads(variant), conv_out)


def _gdn_decode(op: Callable[..., tuple[Tensor, Tensor]]) -> GdnDecode:
    def entry(
        w: GdnLayerView, variant: Variant, x: Tensor, conv_slots: Tensor, rec_slots: Tensor, batch: StepBatch
    ) -> tuple[Tensor, Tensor]:
        return op(_gdn_weights(w), _gdn_heads(variant), x, conv_slots, rec_slots, batch)

    return entry


def _gdn_prefill(op: Callable[..., Tensor]) -> GdnStep:
    def entry(
        w: GdnLayerView, variant: Variant, mixed_qkv: Tensor, a: Tensor, b: Tensor, conv_slots: Tensor,
        rec_slots: Tensor, batch: StepBatch,
    ) -> Tensor:  # fmt: skip
        return op(_gdn_weights(w), _gdn_heads(variant), mixed_qkv, a, b, conv_slots, rec_slots, batch)

    return entry


def _prologue(op: Callable[..., Tensor]) -> Prologue:
    def entry(
        qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, k_pages: Tensor,
        v_pages: Tensor, slot_mapping: Tensor, variant: Variant,
    ) -> Tensor:  # fmt: skip
        return op(qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping, _attention_heads(variant))

    return entry


def _moe(op: Callable[[moe.MoeMlpWeights, Tensor, int, bool], Tensor]) -> Callable[..., Tensor]:
    def entry(w: MoeMlpView, variant: Variant, x: Tensor, decode: bool) -> Tensor:
        return op(_moe_weights(w), x, variant.num_experts_per_tok, decode)

    return entry


# ---- the two tables ---------------------------------------------------------------------------------


REFERENCE = Kernels(
    name="reference",
    rms_norm=norm.rms_norm,
    add_rms_norm=norm.add_rms_norm,
    gated_rms_norm=norm.gated_rms_norm,
    swiglu=swiglu,
    gdn_decode=_gdn_decode(gdn.gdn_decode),
    gdn_prefill=_gdn_prefill(gdn.gdn_prefill),
    gated_decode_attention=attention.gated_decode_attention,
    gated_prefill_attention=attention.gated_prefill_attention,
    block_attention=attention.paged_block_attention,
    attention_prologue=_prologue(attention.attention_prologue),
    moe_block=_moe(moe.moe_mlp),
    linear=F.linear,
    linear_add_rms_norm=linear.linear_add_rms_norm,
    mrope_cos_sin=mrope_cos_sin,
    vision_qkv_rotary=vision_qkv_rotary,
    linear_gelu_tanh=linear.linear_gelu_tanh,
    logits=linear.logits,
    argmax=argmax_rows,
)


def fast_kernels() -> Kernels:
    """The CUDA table: every op that has a fast implementation takes it (imports Triton and fla-core)."""
    from ninfer.ops.triton.activation import swiglu as triton_swiglu
    from ninfer.ops.triton.argmax import argmax_rows as triton_argmax_rows
    from ninfer.ops.triton.rope import mrope_cos_sin as triton_mrope_cos_sin
    from ninfer.ops.triton.vision_rope import vision_qkv_rotary as triton_vision_qkv_rotary

    gdn_prefill = gdn.fast_gdn_prefill
    try:  # the `gpu` extra; without it prefill keeps the reference delta rule (correct, slower)
        import fla  # noqa: F401
    except ImportError:
        warnings.warn(
            "fla-core is not installed (pip install 'ninfer[gpu]'): GDN prefill runs the reference op",
            stacklevel=2,
        )
        gdn_prefill = gdn.gdn_prefill
    return replace(
        REFERENCE,
        name="fast",
        rms_norm=norm.fast_rms_norm,
        add_rms_norm=norm.fast_add_rms_norm,
        gated_rms_norm=norm.fast_gated_rms_norm,
        swiglu=triton_swiglu,
        gdn_decode=_gdn_decode(gdn.fast_gdn_decode),
        gdn_prefill=_gdn_prefill(gdn_prefill),
        gated_decode_attention=attention.fast_gated_decode_attention,
        gated_prefill_attention=attention.fast_gated_prefill_attention,
        block_attention=attention.fast_paged_block_attention,
        attention_prologue=_prologue(attention.fast_attention_prologue),
        moe_block=_moe(moe.fast_moe_mlp),
        linear=linear.fast_linear,
        linear_add_rms_norm=linear.fast_linear_add_rms_norm,
        mrope_cos_sin=triton_mrope_cos_sin,
        vision_qkv_rotary=triton_vision_qkv_rotary,
        linear_gelu_tanh=linear.fast_linear_gelu_tanh,
        logits=linear.fast_logits,
        argmax=triton_argmax_rows,
    )


def fla_available() -> bool:
    """fla-core (the `gpu` extra) is importable: the fast table's GDN prefill is fla's, which a prefill
    graph's padded chunk needs (`gdn.fast_gdn_prefill`)."""
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def kernels_name(device: torch.device, requested: str = "auto") -> str:
    """Which table ``requested`` means on ``device`` (`ninfer.targets.open.resolve_kernels`)."""
    from ninfer.targets.open import resolve_kernels

    return resolve_kernels(device, requested)


def select_kernels(device: torch.device, requested: str = "auto") -> Kernels:
    """The table `kernels_name` names, built once per Program."""
    return REFERENCE if kernels_name(device, requested) == "reference" else fast_kernels()
