"""The roofline of one package: bytes a decode step must read, FLOPs a prefill (and the vision tower) must do.

Decode is memory bound: its floor is the bytes one step has to bring from memory over the bandwidth the
same run measured. Prefill is compute bound: its floor is its FLOPs over the matmul throughput the same
run measured. Everything here is counted from the package's `Variant` and weight schema, never from a
loaded model, so the numbers are exact, testable by hand and the same for real and synthetic weights.

What one decode step of ``B`` sequences at ``context`` positions reads:
- every text-model weight once (the output head in full, ``B`` rows of the embedding, of a MoE layer's
  routed experts only those the ``B`` tokens can select: `moe_experts_read`); the MTP and vision
  weights are resident but not read by a plain decode step and are reported apart (``not_read``);
- the GDN recurrent state (fp32) and conv state of the ``B`` sequences;
- K and V of ``B x context`` positions in every full-attention layer.
The write-back of the GDN state (as large as its read) is not counted: the floor is a read floor.

Storage widths follow the Program: fp32-pinned weights (GDN ``A_log``/``dt_bias``) and the recurrent
state stay fp32, every other weight, the conv state and the KV pages are in the compute dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.targets.qwen3_6.variant import Variant, VisionDims
from ninfer.targets.qwen3_6.weights import weight_schema

EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
EMBEDDING = "embed_tokens.weight"
OUTPUT_HEAD = "lm_head.weight"
FP32_BYTES = 4
# FLOPs per token, value head and (key dim x value dim) state element of the delta-rule recurrence:
# k^T S, the rank-1 update and q^T S, each a multiply-add over the whole state (decay and gating are
# elementwise and not counted)
GDN_FLOPS_PER_STATE_ELEMENT = 6

MOE_ASSUMPTION = (
    "MoE: a decode step of B tokens reads min(E, B x top_k) routed experts per layer (every token picks "
    "experts no other token picked: an upper bound; random routing at E=256, top-8, B=8 picks ~57 of 64)"
)
DECODE_ASSUMPTIONS = (
    "decode bytes = text weights (output head in full, B embedding rows) + B x GDN state (fp32 "
    "recurrent + conv) + K/V of B x context positions; MTP and vision weights are not read; state "
    "write-back not counted",
    "bandwidth = bytes moved (read + write) by a large device copy, median after warm-up",
    "prefill FLOPs = 2 x active matrix params x tokens (output head for the last token only) + causal "
    "attention (2 x heads x head_dim x T(T+1) per layer) + GDN recurrence (6 x state size per token)",
)


def moe_experts_read(num_experts: int, top_k: int, tokens: int) -> int:
    """Distinct routed experts one MoE layer reads for ``tokens`` tokens: each token selects ``top_k``,
    so at most ``tokens x top_k``, and never more than the layer has."""
    if num_experts < 1 or top_k < 1 or tokens < 1:
        raise ValueError(f"need num_experts, top_k, tokens >= 1, got {num_experts}, {top_k}, {tokens}")
    return min(num_experts, tokens * top_k)


def dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class DecodeBytes:
    """Bytes one decode step must read, by source (see the module docstring)."""

    batch: int
    context: int
    weights: int  # text weights read once: every layer (routed experts: only those read), norm, output head
    embedding_rows: int  # the B embedding rows the step's input tokens select
    state: int  # GDN recurrent (fp32) + conv state of B sequences
    kv: int  # K and V of B x context positions, every full-attention layer
    not_read: int  # MTP + vision weights: resident, not read by a plain decode step
    experts_per_layer: int  # routed experts counted per MoE layer (0 for a dense package)
    state_write: int = 0  # the GDN state written back (``state`` again), when asked for; else 0

    @property
    def total(self) -> int:
        return self.weights + self.embedding_rows + self.state + self.state_write + self.kv


def state_bytes_per_sequence(variant: Variant, dtype: torch.dtype) -> int:
    """GDN recurrent state (always fp32) plus conv state (compute dtype) of one sequence, all GDN layers."""
    recurrent = variant.linear_num_value_heads * variant.linear_key_head_dim * variant.linear_value_head_dim
    conv = variant.conv_dim * (variant.linear_conv_kernel_dim - 1)
    return len(variant.gdn_layers) * (recurrent * FP32_BYTES + conv * dtype_bytes(dtype))


def kv_bytes_per_position(variant: Variant, dtype: torch.dtype) -> int:
    """K plus V of one position in every full-attention layer."""
    return len(variant.attention_layers) * 2 * variant.kv_dim * dtype_bytes(dtype)


def decode_step_bytes(
    variant: Variant, batch: int, context: int, dtype: torch.dtype, *, state_write: bool = False
) -> DecodeBytes:
    """Bytes one decode step of ``batch`` sequences, each at ``context`` positions, must read; with
    ``state_write`` also the GDN state it writes back (the bandwidth probe counts read + write bytes, and
    at long context the floor is compared closely enough for the 147 MiB a row on the 27B to matter)."""
    if batch < 1 or context < 0:
        raise ValueError(f"need batch >= 1 and context >= 0, got batch={batch}, context={context}")
    width = dtype_bytes(dtype)
    experts = moe_experts_read(variant.num_experts, variant.num_experts_per_tok, batch) if variant.moe else 0
    weights = not_read = 0
    for spec in weight_schema(variant):
        size = math.prod(spec.shape) * (FP32_BYTES if spec.keep_fp32 else width)
        if spec.group != "text":
            not_read += size
        elif spec.name == EMBEDDING:
            if variant.tie_word_embeddings:  # the output head is this matrix, read in full
                weights += size
        elif spec.name.endswith(EXPERT_TENSORS):
            weights += size // variant.num_experts * experts  # [E, ...]: per-expert slices
        else:
            weights += size
    return DecodeBytes(
        batch=batch,
        context=context,
        weights=weights,
        embedding_rows=min(batch, variant.vocab_size) * variant.hidden_size * width,
        state=batch * state_bytes_per_sequence(variant, dtype),
        state_write=batch * state_bytes_per_sequence(variant, dtype) if state_write else 0,
        kv=batch * context * kv_bytes_per_position(variant, dtype),
        not_read=not_read,
        experts_per_layer=experts,
    )


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of prefilling one prompt of ``tokens`` tokens (see the module docstring)."""

    tokens: int
    linear: int  # 2 x active matrix params x tokens, plus the output head for the last position
    attention: int  # causal QK^T and PV of the full-attention layers
    recurrence: int  # GDN delta-rule state products

    @property
    def total(self) -> int:
        return self.linear + self.attention + self.recurrence


def active_matrix_params(variant: Variant) -> int:
    """Matrix (and depthwise conv) parameters one token multiplies through in the text layers: routed
    experts count ``top_k`` of ``E``; the embedding (a lookup), the output head and norms are excluded."""
    total = 0
    for spec in weight_schema(variant):
        if spec.group != "text" or len(spec.shape) < 2 or spec.name in (EMBEDDING, OUTPUT_HEAD):
            continue
        n = math.prod(spec.shape)
        if spec.name.endswith(EXPERT_TENSORS):
            n = n // variant.num_experts * variant.num_experts_per_tok
        total += n
    return total


def prefill_flops(variant: Variant, tokens: int) -> PrefillFlops:
    """FLOPs of a prefill of ``tokens`` prompt tokens that samples one token (logits of the last only)."""
    if tokens < 1:
        raise ValueError(f"need tokens >= 1, got {tokens}")
    head = variant.vocab_size * variant.hidden_size
    attention_per_layer = 2 * variant.num_attention_heads * variant.head_dim * tokens * (tokens + 1)
    state = variant.linear_num_value_heads * variant.linear_key_head_dim * variant.linear_value_head_dim
    return PrefillFlops(
        tokens=tokens,
        linear=2 * active_matrix_params(variant) * tokens + 2 * head,
        attention=len(variant.attention_layers) * attention_per_layer,
        recurrence=len(variant.gdn_layers) * GDN_FLOPS_PER_STATE_ELEMENT * state * tokens,
    )


# ---- the vision tower -------------------------------------------------------------------------------

VISION_ASSUMPTION = (
    "vision tower FLOPs = patch embed (2 x patches x in_channels*temporal*patch^2 x hidden) + per block: QKV "
    "(2 x patches x hidden x 3 hidden), output projection (2 x patches x hidden^2), bidirectional attention "
    "within each frame (QK^T and PV: 4 x hidden x frame_patches^2 per frame), MLP (2 x 2 x patches x "
    "hidden x intermediate) + merger (fc1 2 x blocks x (hidden m^2)^2, fc2 2 x blocks x hidden m^2 x "
    "out_hidden, blocks = patches / m^2); norms, GELU, rotary and the position-table resampling not counted"
)


@dataclass(frozen=True)
class VisionFlops:
    """FLOPs of the vision tower over some images (see `VISION_ASSUMPTION`)."""

    patches: int  # sum of t*h*w over the images
    patch_embed: int
    qkv: int  # every block
    proj: int
    attention: int  # QK^T and PV inside each frame, every block
    mlp: int
    merger: int

    @property
    def total(self) -> int:
        return self.patch_embed + self.qkv + self.proj + self.attention + self.mlp + self.merger


def vision_flops(dims: VisionDims, grids: Sequence[tuple[int, int, int]]) -> VisionFlops:
    """FLOPs of `ninfer.targets.qwen3_6.vision.vision_embeddings` for images of these ``grid_thw``
    (frames x patch rows x patch columns each)."""
    c, inter, m2 = dims.hidden_size, dims.intermediate_size, dims.spatial_merge_size**2
    patch_width = dims.in_channels * dims.temporal_patch_size * dims.patch_size**2
    patches = attention = 0
    for t, h, w in grids:
        if min(t, h, w) < 1 or (h * w) % m2:
            raise ValueError(f"grid {(t, h, w)} is not t, h, w >= 1 with h*w a multiple of {m2}")
        patches += t * h * w
        attention += t * 4 * c * (h * w) ** 2
    blocks = patches // m2
    return VisionFlops(
        patches=patches,
        patch_embed=2 * patches * patch_width * c,
        qkv=dims.depth * 2 * patches * c * 3 * c,
        proj=dims.depth * 2 * patches * c * c,
        attention=dims.depth * attention,
        mlp=dims.depth * 2 * 2 * patches * c * inter,
        merger=2 * blocks * (c * m2) ** 2 + 2 * blocks * c * m2 * dims.out_hidden_size,
    )
