"""The DFlash block drafter's math (z-lab's ``DFlashDraftModel``; shared/reference/speculative-decoding.md
section 1), over the same paged KV as the text model.

The drafter sees the target through context vectors: for each committed position p, the target's hidden
states after the tap layers (`DFlashDims.target_layer_ids`, transformers' ``hidden_states[i + 1]``)
concatenated, through ``fc`` and ``hidden_norm``. Every drafter layer projects them with its own k/v
projections into its KV at p (`write_context`): context positions have no queries and skip the MLP.
A block (`block`) is T positions from a row's frontier: the pending token (the anchor) and T - 1 mask
tokens, embedded with the target's embeddings; its queries see the whole context and the block itself
(bidirectional in a full-attention layer; causal within the window in a sliding one); its outputs at
positions 1..T - 1, through ``norm`` and the target's ``lm_head``, are the T - 1 drafts of one forward.

The block's own K/V go into the pages at its positions, past the frontier: provisional, like a
verify's, and overwritten by the context K/V of whatever is committed there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.attention import kv_write
from ninfer.ops.norm import plain_rms_norm
from ninfer.ops.rope import apply_partial_rope, rope_cos_sin
from ninfer.targets.qwen3_6.kernels import REFERENCE, Kernels
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.qwen3_6.variant import DFlashDims
from ninfer.targets.qwen3_6.view import DFlashLayerView, ModelView

Tensor = torch.Tensor

__all__ = ["context_vectors", "write_context", "block"]


def _drafter(view: ModelView) -> tuple[DFlashDims, list[DFlashLayerView]]:
    dims, drafter = view.variant.dflash, view.dflash
    if dims is None or drafter is None:
        raise ValueError("this model has no DFlash drafter")
    return dims, list(drafter.layers)


def context_vectors(view: ModelView, taps: Tensor, kernels: Kernels = REFERENCE) -> Tensor:
    """taps [N, n_taps * H] (the target's tap-layer states at N positions, concatenated in
    ``target_layer_ids`` order) -> the context vectors [N, H]."""
    dims, _ = _drafter(view)
    assert view.dflash is not None
    return plain_rms_norm(kernels.linear(taps, view.dflash.fc), view.dflash.hidden_norm, dims.rms_norm_eps)


def _heads(x: Tensor, norm: Tensor, dims: DFlashDims, cos: Tensor, sin: Tensor) -> Tensor:
    """[N, n * D] projections -> per-head q_norm/k_norm, then RoPE over the whole head: [N, n, D]."""
    x = x.view(x.shape[0], -1, dims.head_dim)
    return apply_partial_rope(plain_rms_norm(x, norm, dims.rms_norm_eps), cos, sin)


def _key_values(
    layer: DFlashLayerView, dims: DFlashDims, x: Tensor, cos: Tensor, sin: Tensor, kernels: Kernels
) -> tuple[Tensor, Tensor]:
    if layer.kv_proj is not None:  # one GEMM for k and v
        k, v = kernels.linear(x, layer.kv_proj).split(dims.kv_dim, dim=-1)
    else:
        k, v = kernels.linear(x, layer.k_proj), kernels.linear(x, layer.v_proj)
    return _heads(k, layer.k_norm, dims, cos, sin), v.reshape(x.shape[0], dims.num_kv_heads, dims.head_dim)


def write_context(
    view: ModelView,
    context: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    store: StateStore,
    kernels: Kernels = REFERENCE,
) -> None:
    """Each drafter layer's K/V of the context vectors [N, H] at ``positions`` [N] (sequence positions:
    the drafter's RoPE is 1-D whatever the target's M-RoPE says) into ``store``'s pages at
    ``slot_mapping`` [N]."""
    dims, layers = _drafter(view)
    cos, sin = rope_cos_sin(positions, dims.head_dim, dims.rope_theta)
    for i, layer in enumerate(layers):
        k, v = _key_values(layer, dims, context, cos, sin, kernels)
        kv_write(store.k_pages[i], store.v_pages[i], k, v, slot_mapping)


def block(
    view: ModelView,
    token_ids: Tensor,
    positions: Tensor,
    slot_mapping: Tensor,
    block_table: Tensor,
    context_lens: Tensor,
    store: StateStore,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """The drafter over B blocks of T positions each: ``token_ids`` [B * T] (each block's anchor, then
    mask tokens) at ``positions`` [B * T], whose K/V go to ``slot_mapping``; row r's context is its
    first context_lens[r] positions (the block's included) in pages ``block_table`` [B, maxp]. Returns
    the normed outputs [B * T, H]: through the target's ``lm_head``, position j's is the draft for
    position j + 1."""
    dims, layers = _drafter(view)
    assert view.dflash is not None
    eps, scale = dims.rms_norm_eps, dims.head_dim**-0.5
    x = F.embedding(token_ids, view.text.embed)
    cos, sin = rope_cos_sin(positions, dims.head_dim, dims.rope_theta)
    for i, layer in enumerate(layers):
        h = plain_rms_norm(x, layer.input_norm, eps)
        q = _heads(kernels.linear(h, layer.q_proj), layer.q_norm, dims, cos, sin)
        k, v = _key_values(layer, dims, h, cos, sin, kernels)
        kv_write(store.k_pages[i], store.v_pages[i], k, v, slot_mapping)
        sliding = dims.layer_types[i] == "sliding_attention"
        o = kernels.block_attention(
            q, store.k_pages[i], store.v_pages[i], block_table, context_lens, scale, causal=sliding,
            window=dims.sliding_window if sliding else None,
        )  # fmt: skip
        x = x + kernels.linear(o.reshape(o.shape[0], -1), layer.o_proj)
        h = plain_rms_norm(x, layer.post_attention_norm, eps)
        act = F.silu(kernels.linear(h, layer.gate_proj)) * kernels.linear(h, layer.up_proj)
        x = x + kernels.linear(act, layer.down_proj)
    return plain_rms_norm(x, view.dflash.norm, eps)
