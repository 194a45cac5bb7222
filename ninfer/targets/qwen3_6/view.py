"""Immutable, typed model view of one Qwen3.6 package: the weights the model math reads, by role.

`ModelView.from_tensors` binds a flat ``name -> tensor`` mapping that follows `weight_schema(variant)`
exactly (every name present with its exact shape, nothing extra) into per-layer views, so the forward
code reads ``layer.mixer.q_proj`` instead of string keys and a wrong checkpoint fails here, listing every
problem at once, instead of deep inside the model. The vision and MTP views are passive: they hold
tensors only; their forward lives elsewhere.

The views never copy: each field is the tensor from the mapping (the conv weight is a squeezed view of
the stored ``[C, 1, K]`` tensor).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ninfer.targets.qwen3_6.variant import LayerKind, Variant
from ninfer.targets.qwen3_6.weights import WeightSpec, weight_schema

Tensor = torch.Tensor
_Getter = Callable[[str], Tensor]  # name -> tensor of the bound mapping

__all__ = [
    "AttentionLayerView",
    "GdnLayerView",
    "DenseMlpView",
    "MoeMlpView",
    "DecoderLayerView",
    "TextModelView",
    "MtpView",
    "DFlashLayerView",
    "DFlashView",
    "VisionBlockView",
    "VisionMergerView",
    "VisionView",
    "ModelView",
    "ModelViewError",
    "place_tensor",
    "stacked_rows",
    "target_dtype",
]


class ModelViewError(ValueError):
    """The tensors do not follow the package's weight schema (missing, wrong shape or extra names)."""


# eq=False everywhere: tensor fields make generated __eq__ meaningless (and it would raise).
@dataclass(frozen=True, eq=False)
class AttentionLayerView:
    """Gated full attention. ``q_proj`` rows are per head ``[query(D) | gate(D)]``, interleaved."""

    q_proj: Tensor  # [nH * 2D, H]
    k_proj: Tensor  # [nKV * D, H]
    v_proj: Tensor  # [nKV * D, H]
    o_proj: Tensor  # [H, nH * D]
    q_norm: Tensor  # [D], zero-centred
    k_norm: Tensor  # [D], zero-centred
    qkv_proj: Tensor | None = None  # [q_proj; k_proj; v_proj] when the binder stacked them (one GEMM)


@dataclass(frozen=True, eq=False)
class GdnLayerView:
    """Gated DeltaNet. ``in_proj_qkv`` rows are ``[q(key_dim) | k(key_dim) | v(value_dim)]``."""

    in_proj_qkv: Tensor  # [conv_dim, H]
    in_proj_z: Tensor  # [value_dim, H]
    in_proj_b: Tensor  # [nv, H]
    in_proj_a: Tensor  # [nv, H]
    conv_weight: Tensor  # [conv_dim, K] (view of the stored [conv_dim, 1, K])
    dt_bias: Tensor  # [nv], fp32
    A_log: Tensor  # [nv], fp32
    norm: Tensor  # [dv], plain (not zero-centred) gated-norm weight
    out_proj: Tensor  # [H, value_dim]
    in_proj: Tensor | None = None  # [in_proj_qkv; in_proj_z; in_proj_b; in_proj_a] when stacked


@dataclass(frozen=True, eq=False)
class DenseMlpView:
    gate_proj: Tensor  # [I, H]
    up_proj: Tensor  # [I, H]
    down_proj: Tensor  # [H, I]
    gate_up_proj: Tensor | None = None  # [gate_proj; up_proj] when stacked


@dataclass(frozen=True, eq=False)
class MoeMlpView:
    """Routed experts (fused layout) plus a sigmoid-gated shared expert."""

    router: Tensor  # [E, H]
    gate_up: Tensor  # [E, 2I, H]: rows [0:I] gate, [I:2I] up
    down: Tensor  # [E, H, I]
    shared_gate_proj: Tensor  # [S, H]
    shared_up_proj: Tensor  # [S, H]
    shared_down_proj: Tensor  # [H, S]
    shared_expert_gate: Tensor  # [1, H]
    # [router; shared_gate_proj; shared_up_proj] when stacked: the MoE input's projections in one GEMM
    input_proj: Tensor | None = None


@dataclass(frozen=True, eq=False)
class DecoderLayerView:
    """One pre-norm decoder layer: ``x += mixer(norm(x)); x += mlp(norm(x))``.

    ``state_index`` is this layer's index among the layers of its kind, i.e. its row in the
    `StateStore` (GDN layers: conv/rec state; attention layers: K/V pages).
    """

    kind: LayerKind
    state_index: int
    mixer: GdnLayerView | AttentionLayerView
    mlp: DenseMlpView | MoeMlpView
    input_norm: Tensor  # [H], zero-centred
    post_attention_norm: Tensor  # [H], zero-centred


@dataclass(frozen=True, eq=False)
class TextModelView:
    embed: Tensor  # [V, H]
    layers: tuple[DecoderLayerView, ...]
    norm: Tensor  # [H], zero-centred
    lm_head: Tensor  # [V, H]; the embedding itself when the package ties them


@dataclass(frozen=True, eq=False)
class MtpView:
    """Multi-token-prediction head (passive). Shares ``embed``/``lm_head`` with the text model."""

    fc: Tensor  # [H, 2H], input is cat[norm_emb(embed), norm_hid(hidden)]
    pre_fc_norm_embedding: Tensor  # [H]
    pre_fc_norm_hidden: Tensor  # [H]
    layers: tuple[DecoderLayerView, ...]  # full-attention layers
    norm: Tensor  # [H]


@dataclass(frozen=True, eq=False)
class DFlashLayerView:
    """One Qwen3 decoder layer of a DFlash drafter (passive; plain-weight RMSNorms)."""

    input_norm: Tensor  # [H]
    q_proj: Tensor  # [nH * D, H]
    k_proj: Tensor  # [nKV * D, H]
    v_proj: Tensor  # [nKV * D, H]
    o_proj: Tensor  # [H, nH * D]
    q_norm: Tensor  # [D]
    k_norm: Tensor  # [D]
    post_attention_norm: Tensor  # [H]
    gate_proj: Tensor  # [I, H]
    up_proj: Tensor  # [I, H]
    down_proj: Tensor  # [H, I]
    kv_proj: Tensor | None  # [2 * nKV * D, H]: k_proj and v_proj stacked (one GEMM), when contiguous


@dataclass(frozen=True, eq=False)
class DFlashView:
    """A DFlash block drafter (passive). Shares ``embed``/``lm_head`` with the text model."""

    fc: Tensor  # [H, n_taps * H] over the target's hidden states after its tap layers, concatenated
    hidden_norm: Tensor  # [H]
    layers: tuple[DFlashLayerView, ...]
    norm: Tensor  # [H]


@dataclass(frozen=True, eq=False)
class VisionBlockView:
    norm1_weight: Tensor
    norm1_bias: Tensor
    norm2_weight: Tensor
    norm2_bias: Tensor
    qkv_weight: Tensor
    qkv_bias: Tensor
    proj_weight: Tensor
    proj_bias: Tensor
    fc1_weight: Tensor
    fc1_bias: Tensor
    fc2_weight: Tensor
    fc2_bias: Tensor


@dataclass(frozen=True, eq=False)
class VisionMergerView:
    norm_weight: Tensor
    norm_bias: Tensor
    fc1_weight: Tensor
    fc1_bias: Tensor
    fc2_weight: Tensor
    fc2_bias: Tensor


@dataclass(frozen=True, eq=False)
class VisionView:
    """Vision tower weights (passive: tensors only)."""

    patch_embed_weight: Tensor  # [C, in_ch, T, P, P]
    patch_embed_bias: Tensor  # [C]
    pos_embed: Tensor  # [num_position_embeddings, C]
    blocks: tuple[VisionBlockView, ...]
    merger: VisionMergerView


@dataclass(frozen=True, eq=False)
class ModelView:
    """Everything a package's model math reads. ``tensors`` is the flat schema-ordered mapping."""

    variant: Variant
    text: TextModelView
    mtp: MtpView | None
    vision: VisionView | None
    tensors: Mapping[str, Tensor]
    dflash: DFlashView | None = None

    @classmethod
    def from_tensors(cls, variant: Variant, tensors: Mapping[str, Tensor]) -> ModelView:
        """Bind ``tensors`` (schema names) into a view; ModelViewError lists every schema violation."""
        schema = weight_schema(variant)
        _check_against_schema(schema, tensors)
        ordered = {spec.name: tensors[spec.name] for spec in schema}
        t = ordered.__getitem__
        text = TextModelView(
            embed=t("embed_tokens.weight"),
            layers=_decoder_layers(variant, "layers.", variant.layer_types, t),
            norm=t("norm.weight"),
            lm_head=t("embed_tokens.weight") if variant.tie_word_embeddings else t("lm_head.weight"),
        )
        mtp = None
        if variant.mtp_num_hidden_layers:
            mtp = MtpView(
                fc=t("mtp.fc.weight"),
                pre_fc_norm_embedding=t("mtp.pre_fc_norm_embedding.weight"),
                pre_fc_norm_hidden=t("mtp.pre_fc_norm_hidden.weight"),
                layers=_decoder_layers(
                    variant, "mtp.layers.", ("full_attention",) * variant.mtp_num_hidden_layers, t
                ),
                norm=t("mtp.norm.weight"),
            )
        vision = _vision_view(variant, t) if variant.vision is not None else None
        dflash = _dflash_view(variant, t) if variant.dflash is not None else None
        return cls(
            variant=variant, text=text, mtp=mtp, vision=vision, tensors=MappingProxyType(ordered),
            dflash=dflash,
        )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ModelView:
        """A new view on ``device``; ``dtype`` casts every tensor except the fp32-pinned ones."""
        moved = {
            spec.name: place_tensor(self.tensors[spec.name], spec, device, dtype)
            for spec in weight_schema(self.variant)
        }
        return ModelView.from_tensors(self.variant, moved)

    @property
    def dtype(self) -> torch.dtype:
        """The model (activation) dtype: that of the embedding."""
        return self.text.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.text.embed.device


def place_tensor(
    tensor: Tensor, spec: WeightSpec, device: torch.device | str | None, dtype: torch.dtype | None
) -> Tensor:
    """Move one schema tensor: fp32-pinned specs become fp32, the others take ``dtype`` when given."""
    return tensor.to(device=device, dtype=target_dtype(spec, tensor.dtype, dtype))


def target_dtype(spec: WeightSpec, stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a schema tensor is bound in: fp32 when pinned, else ``dtype`` when given, else stored."""
    return torch.float32 if spec.keep_fp32 else (dtype or stored)


def stacked_rows(parts: tuple[Tensor, ...]) -> Tensor | None:
    """The one matrix whose consecutive row blocks are ``parts``, if they are laid out so; else None.

    The binder places each `fused_row_groups` group in one buffer; a view bound from tensors laid out
    any other way (a CPU mmap, a test's dict) simply has no stacked matrix and runs one GEMM per part.
    """
    first = parts[0]
    if first.dim() != 2 or not all(p.dim() == 2 and p.is_contiguous() for p in parts):
        return None
    cols, dtype, storage = first.shape[1], first.dtype, first.untyped_storage().data_ptr()
    offset = first.storage_offset()
    for part in parts:
        same = part.dtype == dtype and part.shape[1] == cols and part.device == first.device
        if not same or part.untyped_storage().data_ptr() != storage or part.storage_offset() != offset:
            return None
        offset += part.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, cols), (cols, 1), first.storage_offset())


def _check_against_schema(schema: list[WeightSpec], tensors: Mapping[str, Tensor]) -> None:
    expected = {spec.name: spec.shape for spec in schema}
    missing = [name for name in expected if name not in tensors]
    wrong_shape = [
        f"{name}: {tuple(tensors[name].shape)} != expected {shape}"
        for name, shape in expected.items()
        if name in tensors and tuple(tensors[name].shape) != shape
    ]
    extra = sorted(name for name in tensors if name not in expected)
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing: " + ", ".join(missing))
    if wrong_shape:
        problems.append(f"{len(wrong_shape)} with a wrong shape: " + "; ".join(wrong_shape))
    if extra:
        problems.append(f"{len(extra)} not in the schema: " + ", ".join(extra))
    if problems:
        raise ModelViewError("tensors do not match the weight schema: " + " | ".join(problems))


def _attention_view(p: str, t: _Getter) -> AttentionLayerView:
    a = f"{p}self_attn."
    q, k, v = t(f"{a}q_proj.weight"), t(f"{a}k_proj.weight"), t(f"{a}v_proj.weight")
    return AttentionLayerView(
        q_proj=q,
        k_proj=k,
        v_proj=v,
        o_proj=t(f"{a}o_proj.weight"),
        q_norm=t(f"{a}q_norm.weight"),
        k_norm=t(f"{a}k_norm.weight"),
        qkv_proj=stacked_rows((q, k, v)),
    )


def _gdn_view(p: str, t: _Getter) -> GdnLayerView:
    g = f"{p}linear_attn."
    parts = tuple(t(f"{g}{n}.weight") for n in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
    return GdnLayerView(
        in_proj_qkv=parts[0],
        in_proj_z=parts[1],
        in_proj_b=parts[2],
        in_proj_a=parts[3],
        in_proj=stacked_rows(parts),
        conv_weight=t(f"{g}conv1d.weight").squeeze(1),
        dt_bias=t(f"{g}dt_bias"),
        A_log=t(f"{g}A_log"),
        norm=t(f"{g}norm.weight"),
        out_proj=t(f"{g}out_proj.weight"),
    )


def _mlp_view(variant: Variant, p: str, t: _Getter) -> DenseMlpView | MoeMlpView:
    m = f"{p}mlp."
    if not variant.moe:
        gate, up = t(f"{m}gate_proj.weight"), t(f"{m}up_proj.weight")
        return DenseMlpView(
            gate_proj=gate,
            up_proj=up,
            down_proj=t(f"{m}down_proj.weight"),
            gate_up_proj=stacked_rows((gate, up)),
        )
    router, shared_gate = t(f"{m}gate.weight"), t(f"{m}shared_expert_gate.weight")
    gate, up = t(f"{m}shared_expert.gate_proj.weight"), t(f"{m}shared_expert.up_proj.weight")
    return MoeMlpView(
        router=router,
        gate_up=t(f"{m}experts.gate_up_proj"),
        down=t(f"{m}experts.down_proj"),
        shared_gate_proj=gate,
        shared_up_proj=up,
        shared_down_proj=t(f"{m}shared_expert.down_proj.weight"),
        shared_expert_gate=shared_gate,
        input_proj=stacked_rows((router, gate, up)),
    )


def _decoder_layers(
    variant: Variant, prefix: str, kinds: tuple[LayerKind, ...], t: _Getter
) -> tuple[DecoderLayerView, ...]:
    layers = []
    seen = {"linear_attention": 0, "full_attention": 0}
    for i, kind in enumerate(kinds):
        p = f"{prefix}{i}."
        mixer = _gdn_view(p, t) if kind == "linear_attention" else _attention_view(p, t)
        layers.append(
            DecoderLayerView(
                kind=kind,
                state_index=seen[kind],
                mixer=mixer,
                mlp=_mlp_view(variant, p, t),
                input_norm=t(f"{p}input_layernorm.weight"),
                post_attention_norm=t(f"{p}post_attention_layernorm.weight"),
            )
        )
        seen[kind] += 1
    return tuple(layers)


def _dflash_view(variant: Variant, t: _Getter) -> DFlashView:
    assert variant.dflash is not None
    layers = []
    for i in range(variant.dflash.num_layers):
        p = f"dflash.layers.{i}."
        k, v = t(f"{p}self_attn.k_proj.weight"), t(f"{p}self_attn.v_proj.weight")
        layers.append(
            DFlashLayerView(
                input_norm=t(f"{p}input_layernorm.weight"),
                q_proj=t(f"{p}self_attn.q_proj.weight"),
                k_proj=k,
                v_proj=v,
                o_proj=t(f"{p}self_attn.o_proj.weight"),
                q_norm=t(f"{p}self_attn.q_norm.weight"),
                k_norm=t(f"{p}self_attn.k_norm.weight"),
                post_attention_norm=t(f"{p}post_attention_layernorm.weight"),
                gate_proj=t(f"{p}mlp.gate_proj.weight"),
                up_proj=t(f"{p}mlp.up_proj.weight"),
                down_proj=t(f"{p}mlp.down_proj.weight"),
                kv_proj=stacked_rows((k, v)),
            )
        )
    return DFlashView(
        fc=t("dflash.fc.weight"), hidden_norm=t("dflash.hidden_norm.weight"), layers=tuple(layers),
        norm=t("dflash.norm.weight"),
    )  # fmt: skip


def _vision_view(variant: Variant, t: _Getter) -> VisionView:
    assert variant.vision is not None
    blocks = []
    for i in range(variant.vision.depth):
        b = f"visual.blocks.{i}."
        blocks.append(
            VisionBlockView(
                norm1_weight=t(f"{b}norm1.weight"),
                norm1_bias=t(f"{b}norm1.bias"),
                norm2_weight=t(f"{b}norm2.weight"),
                norm2_bias=t(f"{b}norm2.bias"),
                qkv_weight=t(f"{b}attn.qkv.weight"),
                qkv_bias=t(f"{b}attn.qkv.bias"),
                proj_weight=t(f"{b}attn.proj.weight"),
                proj_bias=t(f"{b}attn.proj.bias"),
                fc1_weight=t(f"{b}mlp.linear_fc1.weight"),
                fc1_bias=t(f"{b}mlp.linear_fc1.bias"),
                fc2_weight=t(f"{b}mlp.linear_fc2.weight"),
                fc2_bias=t(f"{b}mlp.linear_fc2.bias"),
            )
        )
    return VisionView(
        patch_embed_weight=t("visual.patch_embed.proj.weight"),
        patch_embed_bias=t("visual.patch_embed.proj.bias"),
        pos_embed=t("visual.pos_embed.weight"),
        blocks=tuple(blocks),
        merger=VisionMergerView(
            norm_weight=t("visual.merger.norm.weight"),
            norm_bias=t("visual.merger.norm.bias"),
            fc1_weight=t("visual.merger.linear_fc1.weight"),
            fc1_bias=t("visual.merger.linear_fc1.bias"),
            fc2_weight=t("visual.merger.linear_fc2.weight"),
            fc2_bias=t("visual.merger.linear_fc2.bias"),
        ),
    )
