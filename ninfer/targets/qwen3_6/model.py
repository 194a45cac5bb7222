"""The Qwen3.6 text forward over explicit state: one flattened token batch of B rows at any positions.

The caller (the Program) owns all state and says, as plain tensor data, where each row reads and
writes it: GDN state slots (``state_in`` / ``state_out`` / ``fresh``) and KV pages (``block_table`` /
``slot_mapping``). The same `forward` serves prefill, chunked prefill, mixed steps and decode:

- Attention is varlen over the flattened batch (paged KV), so it never loops over rows here.
- Gated DeltaNet is per sequence: when any row has more than one token (prefill / mixed steps) it loops
  over rows (causal conv + chunked delta rule, or the one-token step for 1-token rows). When every row
  has exactly one token (decode, known from shapes alone: N == B) it runs one batched path with no
  Python loop over rows and no host sync: state slots are gathered, stepped and scattered as tensors,
  and attention and MoE take their static-shape decode kernels, so a CUDA graph per B can capture it.

GDN state reads all happen before writes (gather, compute, scatter), so a row may write its state back
into the slot it read (``state_out == state_in``). Distinct rows must write distinct slots.

Math: shared/reference/qwen3_6-architecture.md section 2; oracle: transformers'
``Qwen3_5(Moe)ForCausalLM`` (tests/model).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ninfer.ops.attention import (
    gated_attention_output,
    kv_write,
    paged_attention,
    paged_decode_attention,
    split_q_gate,
)
from ninfer.ops.conv import causal_conv1d, causal_conv1d_update
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule
from ninfer.ops.mlp import swiglu_mlp
from ninfer.ops.moe import moe_block
from ninfer.ops.norm import gated_rms_norm, rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import (
    AttentionLayerView,
    DecoderLayerView,
    DenseMlpView,
    GdnLayerView,
    ModelView,
    MoeMlpView,
)

Tensor = torch.Tensor
LogitsMode = Literal["last", "all", "none"]

__all__ = [
    "StateStore",
    "StepBatch",
    "ForwardOutput",
    "forward",
    "decoder_layer",
    "attention_mixer",
    "attention_projection",
    "gdn_mixer",
    "gdn_projection",
    "gdn_split_heads",
    "gdn_output",
    "mlp",
]


# ---- state and batch ----------------------------------------------------------------------------


@dataclass(eq=False)
class StateStore:
    """Physical model state: GDN state slots and paged KV, indexed by plain tensor data.

    conv:    [n_gdn, S, conv_dim, K-1]  last K-1 conv inputs per slot, model dtype
    rec:     [n_gdn, S, nv, dk, dv]     recurrent state per slot, always fp32
    k_pages: [n_attn, P, page_size, n_kv, D]; v_pages alike. Token slot s = page * page_size + offset.
    """

    conv: Tensor
    rec: Tensor
    k_pages: Tensor
    v_pages: Tensor

    @classmethod
    def allocate(
        cls,
        variant: Variant,
        num_slots: int,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> StateStore:
        n_gdn, n_attn = len(variant.gdn_layers), len(variant.attention_layers)
        kv_shape = (n_attn, num_pages, page_size, variant.num_kv_heads, variant.head_dim)
        return cls(
            conv=torch.zeros(
                n_gdn,
                num_slots,
                variant.conv_dim,
                variant.linear_conv_kernel_dim - 1,
                dtype=dtype,
                device=device,
            ),
            rec=torch.zeros(
                n_gdn,
                num_slots,
                variant.linear_num_value_heads,
                variant.linear_key_head_dim,
                variant.linear_value_head_dim,
                dtype=torch.float32,
                device=device,
            ),
            k_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
            v_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
        )

    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def num_pages(self) -> int:
        return self.k_pages.shape[1]

    @property
    def page_size(self) -> int:
        return self.k_pages.shape[2]


@dataclass(frozen=True, eq=False)
class StepBatch:
    """One execution step over B rows holding N new tokens in total (every row has at least one).

    token_ids     [N] long
    positions     [3, N] long     M-RoPE T/H/W positions (text: three equal rows)
    query_start   [B+1] int32     row r owns tokens query_start[r]:query_start[r+1]
    context_lens  [B] int32       tokens in the row's KV after this step, the new ones included
    block_table   [B, maxp] int32 the row's KV pages in order
    slot_mapping  [N] long        flat KV slot (page * page_size + offset) of each new token
    state_in      [B] long        GDN slot each row reads
    state_out     [B] long        GDN slot each row writes its final state to (may equal state_in)
    fresh         [B] bool        the row starts from zero GDN state instead of reading state_in
    inputs_embeds [N, H] | None   replaces the token embeddings (vision)
    """

    token_ids: Tensor
    positions: Tensor
    query_start: Tensor
    context_lens: Tensor
    block_table: Tensor
    slot_mapping: Tensor
    state_in: Tensor
    state_out: Tensor
    fresh: Tensor
    inputs_embeds: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.query_start.shape[0] - 1

    @property
    def is_decode(self) -> bool:
        """Every row has exactly one token; decided from shapes only (no host sync)."""
        return self.num_tokens == self.num_rows


@dataclass(frozen=True, eq=False)
class ForwardOutput:
    hidden: Tensor  # [N, H] after the final norm
    logits: Tensor | None  # fp32: [B, V] (each row's last token), [N, V], or None


# ---- forward -------------------------------------------------------------------------------------


def forward(
    view: ModelView,
    variant: Variant,
    batch: StepBatch,
    store: StateStore,
    *,
    logits: LogitsMode = "last",
) -> ForwardOutput:
    """Run the text model over ``batch``, reading and writing ``store`` in place."""
    text = view.text
    if batch.inputs_embeds is not None:
        x = batch.inputs_embeds.to(text.embed.dtype)
    else:
        x = F.embedding(batch.token_ids, text.embed)
    cos, sin = mrope_cos_sin(batch.positions, variant.rotary_dim, variant.rope_theta, variant.mrope_section)
    for layer in text.layers:
        x = decoder_layer(layer, variant, x, batch, store, cos, sin)
    hidden = rms_norm(x, text.norm, variant.rms_norm_eps)

    if logits == "none":
        return ForwardOutput(hidden=hidden, logits=None)
    if logits == "last":
        selected = hidden.index_select(0, batch.query_start[1:].long() - 1)
    elif logits == "all":
        selected = hidden
    else:
        raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
    return ForwardOutput(hidden=hidden, logits=F.linear(selected, text.lm_head).float())


def decoder_layer(
    layer: DecoderLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    store: StateStore,
    cos: Tensor,
    sin: Tensor,
) -> Tensor:
    """Pre-norm residual layer: ``x += mixer(norm(x)); x += mlp(norm(x))``."""
    eps = variant.rms_norm_eps
    mixer_in = rms_norm(x, layer.input_norm, eps)
    i = layer.state_index
    if isinstance(layer.mixer, GdnLayerView):
        mixed = gdn_mixer(layer.mixer, variant, mixer_in, batch, store.conv[i], store.rec[i])
    else:
        mixed = attention_mixer(
            layer.mixer, variant, mixer_in, batch, store.k_pages[i], store.v_pages[i], cos, sin
        )
    x = x + mixed
    mlp_out = mlp(layer.mlp, variant, rms_norm(x, layer.post_attention_norm, eps), decode=batch.is_decode)
    return x + mlp_out


# ---- gated attention ----------------------------------------------------------------------------


def attention_projection(
    w: AttentionLayerView, variant: Variant, x: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> q [N, nH, D] (normed, roped), gate [N, nH*D], k [N, nKV, D] (normed, roped), v."""
    n, eps = x.shape[0], variant.rms_norm_eps
    q, gate = split_q_gate(F.linear(x, w.q_proj), variant.num_attention_heads, variant.head_dim)
    k = F.linear(x, w.k_proj).view(n, variant.num_kv_heads, variant.head_dim)
    v = F.linear(x, w.v_proj).view(n, variant.num_kv_heads, variant.head_dim)
    q = apply_partial_rope(rms_norm(q, w.q_norm, eps), cos, sin)
    k = apply_partial_rope(rms_norm(k, w.k_norm, eps), cos, sin)
    return q, gate, k, v


def attention_mixer(
    w: AttentionLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    k_pages: Tensor,
    v_pages: Tensor,
    cos: Tensor,
    sin: Tensor,
) -> Tensor:
    """Gated attention over the paged KV of this layer; writes the new tokens' K/V first."""
    q, gate, k, v = attention_projection(w, variant, x, cos, sin)
    kv_write(k_pages, v_pages, k, v, batch.slot_mapping)
    scale = variant.head_dim**-0.5
    if batch.is_decode:  # one query per row: the graph-capturable kernel (no host sync)
        o = paged_decode_attention(q, k_pages, v_pages, batch.block_table, batch.context_lens, scale)
    else:
        o = paged_attention(
            q, k_pages, v_pages, batch.block_table, batch.query_start, batch.context_lens, scale
        )
    return F.linear(gated_attention_output(o, gate), w.o_proj)


# ---- Gated DeltaNet -----------------------------------------------------------------------------


def gdn_projection(w: GdnLayerView, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> mixed_qkv [N, conv_dim] (to be convolved), z [N, value_dim], a [N, nv], b [N, nv]."""
    return (
        F.linear(x, w.in_proj_qkv),
        F.linear(x, w.in_proj_z),
        F.linear(x, w.in_proj_a),
        F.linear(x, w.in_proj_b),
    )


def gdn_split_heads(variant: Variant, conv_out: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Conv output [..., conv_dim] -> q, k [..., nv, dk], v [..., nv, dv].

    Key heads are repeated so that value head j reads key head j // (nv / nk).
    """
    key_dim, nk, nv = variant.linear_key_dim, variant.linear_num_key_heads, variant.linear_num_value_heads
    lead = conv_out.shape[:-1]
    q, k, v = conv_out.split([key_dim, key_dim, variant.linear_value_dim], dim=-1)
    q = q.reshape(*lead, nk, variant.linear_key_head_dim).repeat_interleave(nv // nk, dim=-2)
    k = k.reshape(*lead, nk, variant.linear_key_head_dim).repeat_interleave(nv // nk, dim=-2)
    return q, k, v.reshape(*lead, nv, variant.linear_value_head_dim)


def gdn_output(w: GdnLayerView, variant: Variant, o: Tensor, z: Tensor) -> Tensor:
    """Delta-rule output o [N, nv, dv] (fp32) -> gated norm with silu(z) -> out_proj -> [N, H]."""
    n, nv, dv = o.shape
    o = o.to(z.dtype)  # HF casts the kernel output to the model dtype before the norm
    normed = gated_rms_norm(o, w.norm, z.view(n, nv, dv), variant.rms_norm_eps)
    return F.linear(normed.reshape(n, nv * dv), w.out_proj)


def gdn_mixer(
    w: GdnLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    conv_slots: Tensor,
    rec_slots: Tensor,
) -> Tensor:
    """Gated DeltaNet over the batch; reads each row's state slot, writes its final state slot.

    conv_slots [S, conv_dim, K-1] and rec_slots [S, nv, dk, dv] are this layer's slices of the store.
    """
    mixed_qkv, z, a, b = gdn_projection(w, x)
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)
    # gather every row's starting state before any write (a row may write the slot another row reads)
    keep = ~batch.fresh
    conv_in = torch.where(keep[:, None, None], conv_slots.index_select(0, batch.state_in), 0)
    rec_in = torch.where(keep[:, None, None, None], rec_slots.index_select(0, batch.state_in), 0)

    if batch.is_decode:
        o, conv_out_state, rec_out = _gdn_decode(w, variant, mixed_qkv, g, beta, conv_in, rec_in)
    else:
        o, conv_out_state, rec_out = _gdn_varlen(w, variant, batch, mixed_qkv, g, beta, conv_in, rec_in)

    conv_slots.index_copy_(0, batch.state_out, conv_out_state.to(conv_slots.dtype))
    rec_slots.index_copy_(0, batch.state_out, rec_out)
    return gdn_output(w, variant, o, z)


def _gdn_decode(
    w: GdnLayerView,
    variant: Variant,
    mixed_qkv: Tensor,
    g: Tensor,
    beta: Tensor,
    conv_in: Tensor,
    rec_in: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """One token per row, all rows at once: rows are the batch dim of the conv step and the recurrence."""
    conv_out, conv_state = causal_conv1d_update(mixed_qkv, conv_in, w.conv_weight)  # [B, C]
    q, k, v = gdn_split_heads(variant, conv_out.unsqueeze(1))  # [B, T=1, nv, d]
    o, rec_state = recurrent_gated_delta_rule(q, k, v, g.unsqueeze(1), beta.unsqueeze(1), rec_in)
    return o[:, 0], conv_state, rec_state


def _gdn_varlen(
    w: GdnLayerView,
    variant: Variant,
    batch: StepBatch,
    mixed_qkv: Tensor,
    g: Tensor,
    beta: Tensor,
    conv_in: Tensor,
    rec_in: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Rows of any length: per-row conv + chunked delta rule (one-token rows take the step path)."""
    bounds = batch.query_start.tolist()  # host sync: only on the prefill / mixed path
    outputs, conv_states, rec_states = [], [], []
    for row in range(batch.num_rows):
        start, end = bounds[row], bounds[row + 1]
        if end - start < 1:
            raise ValueError(f"row {row} has no tokens (query_start {bounds})")
        rows = slice(row, row + 1)
        if end - start == 1:
            o, conv_state, rec_state = _gdn_decode(
                w, variant, mixed_qkv[start:end], g[start:end], beta[start:end], conv_in[rows], rec_in[rows]
            )
        else:
            conv_out, conv_state = causal_conv1d(mixed_qkv[start:end], w.conv_weight, conv_in[row])
            q, k, v = gdn_split_heads(variant, conv_out)  # [T, nv, d]
            o, rec_state = chunk_gated_delta_rule(q, k, v, g[start:end], beta[start:end], rec_in[row])
            conv_state, rec_state = conv_state.unsqueeze(0), rec_state.unsqueeze(0)
        outputs.append(o)
        conv_states.append(conv_state)
        rec_states.append(rec_state)
    return torch.cat(outputs), torch.cat(conv_states), torch.cat(rec_states)


# ---- MLP ------------------------------------------------------------------------------------------


def mlp(w: DenseMlpView | MoeMlpView, variant: Variant, x: Tensor, *, decode: bool = False) -> Tensor:
    """Post-mixer MLP: dense SwiGLU, or routed experts plus the gated shared expert.

    ``decode`` (a few tokens, one per row) takes the MoE path with static shapes and no host sync.
    """
    if isinstance(w, MoeMlpView):
        return moe_block(
            x,
            w.router,
            w.gate_up,
            w.down,
            w.shared_gate_proj,
            w.shared_up_proj,
            w.shared_down_proj,
            w.shared_expert_gate,
            variant.num_experts_per_tok,
            graph_safe=decode,
        )
    return swiglu_mlp(x, w.gate_proj, w.up_proj, w.down_proj)
