"""Semantic weight schema of the Qwen3.6 family: every tensor a package's model view holds.

Names are the Hugging Face language-model names with the checkpoint prefixes removed
(``model.language_model.`` -> ``""``, ``model.visual.`` -> ``visual.``, ``mtp.`` and ``lm_head.`` kept;
a DFlash drafter's checkpoint names under ``dflash.``),
and MoE experts always in the fused layout (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``). The converter maps checkpoints onto this schema; the artifact stores
exactly these names in this order; the model view binds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ninfer.targets.qwen3_6.variant import Variant

WeightGroup = Literal["text", "mtp", "vision", "dflash"]


@dataclass(frozen=True)
class WeightSpec:
    name: str
    shape: tuple[int, ...]
    group: WeightGroup
    # float32 in every storage profile: GDN decay parameters stay exact (the family keeps its
    # recurrent state in fp32, and A_log/dt_bias feed the log-decay directly).
    keep_fp32: bool = False


def _attention(p: str, v: Variant, group: WeightGroup) -> list[WeightSpec]:
    H, D = v.hidden_size, v.head_dim
    return [
        WeightSpec(f"{p}self_attn.q_proj.weight", (v.q_proj_dim, H), group),
        WeightSpec(f"{p}self_attn.k_proj.weight", (v.kv_dim, H), group),
        WeightSpec(f"{p}self_attn.v_proj.weight", (v.kv_dim, H), group),
        WeightSpec(f"{p}self_attn.o_proj.weight", (H, v.num_attention_heads * D), group),
        WeightSpec(f"{p}self_attn.q_norm.weight", (D,), group),
        WeightSpec(f"{p}self_attn.k_norm.weight", (D,), group),
    ]


def _gdn(p: str, v: Variant, group: WeightGroup) -> list[WeightSpec]:
    H, nv = v.hidden_size, v.linear_num_value_heads
    return [
        WeightSpec(f"{p}linear_attn.in_proj_qkv.weight", (v.conv_dim, H), group),
        WeightSpec(f"{p}linear_attn.in_proj_z.weight", (v.linear_value_dim, H), group),
        WeightSpec(f"{p}linear_attn.in_proj_b.weight", (nv, H), group),
        WeightSpec(f"{p}linear_attn.in_proj_a.weight", (nv, H), group),
        WeightSpec(f"{p}linear_attn.conv1d.weight", (v.conv_dim, 1, v.linear_conv_kernel_dim), group),
        WeightSpec(f"{p}linear_attn.dt_bias", (nv,), group, keep_fp32=True),
        WeightSpec(f"{p}linear_attn.A_log", (nv,), group, keep_fp32=True),
        WeightSpec(f"{p}linear_attn.norm.weight", (v.linear_value_head_dim,), group),
        WeightSpec(f"{p}linear_attn.out_proj.weight", (H, v.linear_value_dim), group),
    ]


def _mlp(p: str, v: Variant, group: WeightGroup) -> list[WeightSpec]:
    H = v.hidden_size
    if not v.moe:
        inter = v.intermediate_size
        return [
            WeightSpec(f"{p}mlp.gate_proj.weight", (inter, H), group),
            WeightSpec(f"{p}mlp.up_proj.weight", (inter, H), group),
            WeightSpec(f"{p}mlp.down_proj.weight", (H, inter), group),
        ]
    E, inter, S = v.num_experts, v.moe_intermediate_size, v.shared_expert_intermediate_size
    return [
        WeightSpec(f"{p}mlp.gate.weight", (E, H), group),
        WeightSpec(f"{p}mlp.experts.gate_up_proj", (E, 2 * inter, H), group),
        WeightSpec(f"{p}mlp.experts.down_proj", (E, H, inter), group),
        WeightSpec(f"{p}mlp.shared_expert.gate_proj.weight", (S, H), group),
        WeightSpec(f"{p}mlp.shared_expert.up_proj.weight", (S, H), group),
        WeightSpec(f"{p}mlp.shared_expert.down_proj.weight", (H, S), group),
        WeightSpec(f"{p}mlp.shared_expert_gate.weight", (1, H), group),
    ]


def _decoder_layer(p: str, v: Variant, kind: str, group: WeightGroup) -> list[WeightSpec]:
    H = v.hidden_size
    mixer = _attention(p, v, group) if kind == "full_attention" else _gdn(p, v, group)
    return [
        *mixer,
        *_mlp(p, v, group),
        WeightSpec(f"{p}input_layernorm.weight", (H,), group),
        WeightSpec(f"{p}post_attention_layernorm.weight", (H,), group),
    ]


def _vision(v: Variant) -> list[WeightSpec]:
    vd = v.vision
    assert vd is not None
    C, P, T, m = vd.hidden_size, vd.patch_size, vd.temporal_patch_size, vd.spatial_merge_size
    merged = C * m * m
    out: list[WeightSpec] = [
        WeightSpec("visual.patch_embed.proj.weight", (C, vd.in_channels, T, P, P), "vision"),
        WeightSpec("visual.patch_embed.proj.bias", (C,), "vision"),
        WeightSpec("visual.pos_embed.weight", (vd.num_position_embeddings, C), "vision"),
    ]
    for i in range(vd.depth):
        b = f"visual.blocks.{i}."
        out += [
            WeightSpec(f"{b}norm1.weight", (C,), "vision"),
            WeightSpec(f"{b}norm1.bias", (C,), "vision"),
            WeightSpec(f"{b}norm2.weight", (C,), "vision"),
            WeightSpec(f"{b}norm2.bias", (C,), "vision"),
            WeightSpec(f"{b}attn.qkv.weight", (3 * C, C), "vision"),
            WeightSpec(f"{b}attn.qkv.bias", (3 * C,), "vision"),
            WeightSpec(f"{b}attn.proj.weight", (C, C), "vision"),
            WeightSpec(f"{b}attn.proj.bias", (C,), "vision"),
            WeightSpec(f"{b}mlp.linear_fc1.weight", (vd.intermediate_size, C), "vision"),
            WeightSpec(f"{b}mlp.linear_fc1.bias", (vd.intermediate_size,), "vision"),
            WeightSpec(f"{b}mlp.linear_fc2.weight", (C, vd.intermediate_size), "vision"),
            WeightSpec(f"{b}mlp.linear_fc2.bias", (C,), "vision"),
        ]
    out += [
        WeightSpec("visual.merger.norm.weight", (C,), "vision"),
        WeightSpec("visual.merger.norm.bias", (C,), "vision"),
        WeightSpec("visual.merger.linear_fc1.weight", (merged, merged), "vision"),
        WeightSpec("visual.merger.linear_fc1.bias", (merged,), "vision"),
        WeightSpec("visual.merger.linear_fc2.weight", (vd.out_hidden_size, merged), "vision"),
        WeightSpec("visual.merger.linear_fc2.bias", (vd.out_hidden_size,), "vision"),
    ]
    return out


def weight_schema(v: Variant) -> list[WeightSpec]:
    """Every tensor of the package, in the canonical (artifact) order."""
    H = v.hidden_size
    out = [WeightSpec("embed_tokens.weight", (v.vocab_size, H), "text")]
    for i, kind in enumerate(v.layer_types):
        out += _decoder_layer(f"layers.{i}.", v, kind, "text")
    out.append(WeightSpec("norm.weight", (H,), "text"))
    if not v.tie_word_embeddings:
        out.append(WeightSpec("lm_head.weight", (v.vocab_size, H), "text"))
    for i in range(v.mtp_num_hidden_layers):
        out += _decoder_layer(f"mtp.layers.{i}.", v, "full_attention", "mtp")
    if v.mtp_num_hidden_layers:
        out += [
            WeightSpec("mtp.fc.weight", (H, 2 * H), "mtp"),
            WeightSpec("mtp.pre_fc_norm_embedding.weight", (H,), "mtp"),
            WeightSpec("mtp.pre_fc_norm_hidden.weight", (H,), "mtp"),
            WeightSpec("mtp.norm.weight", (H,), "mtp"),
        ]
    if v.vision is not None:
        out += _vision(v)
    if v.dflash is not None:
        out += _dflash(v)
    return out


def _dflash(v: Variant) -> list[WeightSpec]:
    """The DFlash drafter (`DFlashDims`): its checkpoint's names under ``dflash.``; no embedding or head
    of its own (it uses the text model's)."""
    d, H = v.dflash, v.hidden_size
    assert d is not None
    out = []
    for i in range(d.num_layers):
        p = f"dflash.layers.{i}."
        out += [
            WeightSpec(f"{p}input_layernorm.weight", (H,), "dflash"),
            WeightSpec(f"{p}self_attn.q_proj.weight", (d.q_dim, H), "dflash"),
            WeightSpec(f"{p}self_attn.k_proj.weight", (d.kv_dim, H), "dflash"),
            WeightSpec(f"{p}self_attn.v_proj.weight", (d.kv_dim, H), "dflash"),
            WeightSpec(f"{p}self_attn.o_proj.weight", (H, d.q_dim), "dflash"),
            WeightSpec(f"{p}self_attn.q_norm.weight", (d.head_dim,), "dflash"),
            WeightSpec(f"{p}self_attn.k_norm.weight", (d.head_dim,), "dflash"),
            WeightSpec(f"{p}post_attention_layernorm.weight", (H,), "dflash"),
            WeightSpec(f"{p}mlp.gate_proj.weight", (d.intermediate_size, H), "dflash"),
            WeightSpec(f"{p}mlp.up_proj.weight", (d.intermediate_size, H), "dflash"),
            WeightSpec(f"{p}mlp.down_proj.weight", (H, d.intermediate_size), "dflash"),
        ]
    return out + [
        WeightSpec("dflash.fc.weight", (H, len(d.target_layer_ids) * H), "dflash"),
        WeightSpec("dflash.hidden_norm.weight", (H,), "dflash"),
        WeightSpec("dflash.norm.weight", (H,), "dflash"),
    ]


# Projections that read the same input, in the row order the binder stacks them into one device buffer
# so that one GEMM computes them all (a decode step is a sequence of GEMVs: one launch and one pass over
# the input instead of two to four). Members keep their schema names: each is a row block of the buffer.
_ROW_GROUPS_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_ROW_GROUPS_GDN = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_z.weight",
    "linear_attn.in_proj_b.weight",
    "linear_attn.in_proj_a.weight",
)
_ROW_GROUPS_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
# (the 1-row shared_expert_gate stays out: E + 1 + 2S rows would make the output rows misaligned for the
# GEMM, which then takes a slow unaligned kernel)
_ROW_GROUPS_MOE = (
    "mlp.gate.weight",
    "mlp.shared_expert.gate_proj.weight",
    "mlp.shared_expert.up_proj.weight",
)


def fused_row_groups(v: Variant) -> list[tuple[str, ...]]:
    """Text-model weight groups the binder lays out as consecutive row blocks of one buffer."""
    groups: list[tuple[str, ...]] = []
    for i, kind in enumerate(v.layer_types):
        p = f"layers.{i}."
        mixer = _ROW_GROUPS_ATTENTION if kind == "full_attention" else _ROW_GROUPS_GDN
        groups.append(tuple(p + name for name in mixer))
        groups.append(tuple(p + name for name in (_ROW_GROUPS_MOE if v.moe else _ROW_GROUPS_DENSE)))
    return groups
