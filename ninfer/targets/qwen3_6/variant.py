"""The Qwen3.6 family's compile-time `Variant`: every static dimension of one exact package.

A package (``ninfer/targets/<package>``) instantiates the family with one frozen `Variant`. The family
code reads dims only from here; nothing on the hot path asks which package it runs.

`Variant.hf_config()` renders the Hugging Face ``config.json`` a checkpoint of the package carries
(``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5MoeForConditionalGeneration``), and
`Variant.from_hf_config()` reads one back, so a checkpoint matches a package exactly or not at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

LayerKind = Literal["linear_attention", "full_attention"]
DraftLayerKind = Literal["sliding_attention", "full_attention"]


@dataclass(frozen=True)
class VisionDims:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    out_hidden_size: int
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class DFlashDims:
    """A DFlash block drafter of one package (z-lab's ``DFlashDraftModel``; the reference's section 1):
    Qwen3 decoder layers (plain-weight RMSNorms, q/k norms, 1-D RoPE over the whole head, SwiGLU) over
    the target's hidden width, conditioned on the target's hidden states after ``target_layer_ids``.

    Its attention is bidirectional inside a block and sees the whole context, except ``sliding_attention``
    layers, which are causal within ``sliding_window`` positions (the reference model's default)."""

    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    layer_types: tuple[DraftLayerKind, ...]
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int = 16
    sliding_window: int = 2048
    rope_theta: float = 1e7
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        problems = []
        if len(self.layer_types) != self.num_layers:
            problems.append(f"dflash: {len(self.layer_types)} layer_types for {self.num_layers} layers")
        if any(t not in ("sliding_attention", "full_attention") for t in self.layer_types):
            problems.append(f"dflash: unknown layer type in {list(self.layer_types)}")
        if self.num_attention_heads % self.num_kv_heads:
            problems.append("dflash: num_attention_heads must be a multiple of num_kv_heads")
        if not self.target_layer_ids or self.block_size < 2:
            problems.append("dflash: needs target_layer_ids and a block of at least 2 positions")
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def dims(self) -> dict[str, Any]:
        d = asdict(self)
        d["layer_types"], d["target_layer_ids"] = list(self.layer_types), list(self.target_layer_ids)
        return d

    @classmethod
    def from_dims(cls, d: dict[str, Any]) -> DFlashDims:
        d = dict(d)
        d["layer_types"], d["target_layer_ids"] = tuple(d["layer_types"]), tuple(d["target_layer_ids"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> DFlashDims:
        """A DFlash drafter checkpoint's ``config.json`` (``DFlashDraftModel``): ValueError names a
        missing field."""
        if "DFlashDraftModel" not in cfg.get("architectures", ()):
            raise ValueError(f"architectures {cfg.get('architectures')!r} is not a DFlash drafter")
        extra = cfg.get("dflash_config") or {}

        def need(key: str) -> Any:
            if key in extra:
                return extra[key]
            if key not in cfg:
                raise ValueError(f"the DFlash config.json has no {key!r}")
            return cfg[key]

        layers = need("num_hidden_layers")
        types = cfg.get("layer_types") or ["full_attention"] * layers
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or 1e6
        if cfg.get("is_causal") is not None:
            raise ValueError("DFlash configs with an explicit is_causal are not supported")
        return cls(
            num_layers=layers,
            num_attention_heads=need("num_attention_heads"),
            num_kv_heads=need("num_key_value_heads"),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            intermediate_size=need("intermediate_size"),
            layer_types=tuple(types),
            target_layer_ids=tuple(need("target_layer_ids")),
            mask_token_id=need("mask_token_id"),
            block_size=int(extra.get("block_size", cfg.get("block_size", 16))),
            sliding_window=int(cfg.get("sliding_window") or 2048),
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        )

    def hf_config(self, target: Variant) -> dict[str, Any]:
        """The ``config.json`` of a drafter checkpoint of these dims for ``target`` (the reference
        loader's `Qwen3Config` fields)."""
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": target.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "vocab_size": target.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": target.max_position_embeddings,
            "attention_bias": False,
            "layer_types": list(self.layer_types),
            "sliding_window": self.sliding_window,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "num_target_layers": target.num_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "tie_word_embeddings": False,
        }


@dataclass(frozen=True)
class SpecialTokens:
    """Token ids the engine itself must know (the tokenizer owns the strings)."""

    endoftext: int = 248044
    im_start: int = 248045
    im_end: int = 248046
    vision_start: int = 248053
    vision_end: int = 248054
    image_pad: int = 248056
    video_pad: int = 248057
    think_open: int = 248068
    think_close: int = 248069
    eos: tuple[int, ...] = (248046, 248044)


@dataclass(frozen=True)
class Variant:
    """Static dims of one package. ``moe`` is True when every layer's MLP is a routed MoE block."""

    # text stack
    hidden_size: int
    num_layers: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    # dense MLP (moe=False) or routed experts (moe=True)
    moe: bool = False
    intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # fixed family conventions, kept as data so tiny packages can scale them
    linear_conv_kernel_dim: int = 4
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    mtp_num_hidden_layers: int = 1
    vision: VisionDims | None = None
    dflash: DFlashDims | None = None  # the package's DFlash drafter, when one is registered
    special: SpecialTokens = field(default_factory=SpecialTokens)

    def __post_init__(self) -> None:
        problems = []
        if self.moe and not (
            self.num_experts > 0 and self.num_experts_per_tok > 0 and self.moe_intermediate_size > 0
        ):
            problems.append(
                "a MoE variant needs num_experts, num_experts_per_tok and moe_intermediate_size > 0"
            )
        if not self.moe and self.intermediate_size <= 0:
            problems.append("a dense variant needs intermediate_size > 0")
        if self.num_attention_heads % self.num_kv_heads:
            problems.append("num_attention_heads must be a multiple of num_kv_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            problems.append("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if 2 * sum(self.mrope_section) != self.rotary_dim:
            problems.append(
                f"mrope_section {list(self.mrope_section)} must sum to rotary_dim/2 = {self.rotary_dim // 2} "
                f"(head_dim {self.head_dim} x partial_rotary_factor {self.partial_rotary_factor} / 2)"
            )
        taps = self.dflash.target_layer_ids if self.dflash is not None else ()
        if not all(0 <= i < self.num_layers for i in taps):
            problems.append(f"dflash target_layer_ids {list(taps)} outside the {self.num_layers} layers")
        if problems:
            raise ValueError("; ".join(problems))

    # ---- derived dims -------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> tuple[LayerKind, ...]:
        k = self.full_attention_interval
        return tuple(
            "full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_layers)
        )

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def q_proj_dim(self) -> int:
        """Query plus per-head output gate: ``[nH, 2 * head_dim]`` interleaved per head."""
        return self.num_attention_heads * self.head_dim * 2

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def summary_lines(self) -> list[str]:
        """The architecture in two lines, as `ninfer packages` and `ninfer inspect` print it."""
        mlp = (
            f"MoE {self.num_experts}x{self.moe_intermediate_size} top-{self.num_experts_per_tok} "
            f"+ shared {self.shared_expert_intermediate_size}"
            if self.moe
            else f"dense MLP {self.intermediate_size}"
        )
        return [
            f"hidden {self.hidden_size}, {self.num_layers} layers ({len(self.gdn_layers)} GDN + "
            f"{len(self.attention_layers)} attention), vocab {self.vocab_size}, {mlp}",
            f"attention {self.num_attention_heads}q:{self.num_kv_heads}kv x {self.head_dim} "
            f"(rotary {self.rotary_dim}), GDN {self.linear_num_key_heads}k:{self.linear_num_value_heads}v "
            f"x {self.linear_key_head_dim}, MTP layers {self.mtp_num_hidden_layers}, "
            f"vision {'yes' if self.vision else 'no'}, "
            + (
                f"DFlash drafter {self.dflash.num_layers} layers, block {self.dflash.block_size}"
                if self.dflash
                else "no DFlash drafter"
            ),
        ]

    def dims(self) -> dict[str, Any]:
        """Flat JSON-able dims, as stored in a `.ninfer` header and compared on load."""
        d = asdict(self)
        d["mrope_section"] = list(self.mrope_section)
        d["special"]["eos"] = list(self.special.eos)
        if self.dflash is None:  # absent, not null: the dims of packages without a drafter are unchanged
            del d["dflash"]
        else:
            d["dflash"] = self.dflash.dims()
        return d

    @classmethod
    def from_dims(cls, d: dict[str, Any]) -> Variant:
        d = dict(d)
        vision = d.pop("vision", None)
        special = d.pop("special", None)
        dflash = d.pop("dflash", None)
        d["mrope_section"] = tuple(d["mrope_section"])
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown dims field(s): {sorted(unknown)}")
        return cls(
            **d,
            vision=VisionDims(**vision) if vision else None,
            dflash=DFlashDims.from_dims(dflash) if dflash else None,
            special=SpecialTokens(**{**special, "eos": tuple(special["eos"])})
            if special
            else SpecialTokens(),
        )

    # ---- Hugging Face config.json -------------------------------------------------------------
    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` of a Hugging Face checkpoint of this package (with text/vision configs)."""
        s = self.special
        text: dict[str, Any] = {
            "model_type": "qwen3_5_moe_text" if self.moe else "qwen3_5_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attn_output_gate": True,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "full_attention_interval": self.full_attention_interval,
            "layer_types": list(self.layer_types),
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
                "mrope_section": list(self.mrope_section),
                "mrope_interleaved": True,
            },
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "mtp_use_dedicated_embeddings": False,
            "output_gate_type": "swish",
            "mamba_ssm_dtype": "float32",
            "bos_token_id": s.endoftext,
            "eos_token_id": s.endoftext,
            "dtype": "bfloat16",
        }
        if self.moe:
            text.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                norm_topk_prob=True,
            )
        else:
            text["intermediate_size"] = self.intermediate_size
        cfg: dict[str, Any] = {
            "architectures": [
                "Qwen3_5MoeForConditionalGeneration" if self.moe else "Qwen3_5ForConditionalGeneration"
            ],
            "model_type": "qwen3_5_moe" if self.moe else "qwen3_5",
            "text_config": text,
            "image_token_id": s.image_pad,
            "video_token_id": s.video_pad,
            "vision_start_token_id": s.vision_start,
            "vision_end_token_id": s.vision_end,
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.vision is not None:
            v = self.vision
            cfg["vision_config"] = {
                "model_type": "qwen3_5_moe_vision" if self.moe else "qwen3_5_vision",
                "depth": v.depth,
                "hidden_size": v.hidden_size,
                "hidden_act": v.hidden_act,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_channels": v.in_channels,
                "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "temporal_patch_size": v.temporal_patch_size,
                "out_hidden_size": v.out_hidden_size,
                "num_position_embeddings": v.num_position_embeddings,
                "deepstack_visual_indexes": [],
            }
        return cfg

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> Variant:
        """Read the dims of a Hugging Face Qwen3.5/3.6 config (VLM or text-only) into a Variant.

        Raises ValueError naming the field when the config is not of this family.
        """
        model_type = cfg.get("model_type", "")
        text = cfg.get("text_config", cfg)
        text_type = text.get("model_type", model_type)
        if text_type not in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"):
            raise ValueError(f"model_type {text_type!r} is not a Qwen3.5/3.6 family model")
        moe = "moe" in text_type or "num_experts" in text
        rope = text.get("rope_parameters") or {}

        def need(key: str) -> Any:
            if key not in text:
                raise ValueError(f"config.json text_config has no {key!r}")
            return text[key]

        layer_types = text.get("layer_types")
        interval = text.get("full_attention_interval", 4)
        kw: dict[str, Any] = dict(
            hidden_size=need("hidden_size"),
            num_layers=need("num_hidden_layers"),
            vocab_size=need("vocab_size"),
            num_attention_heads=need("num_attention_heads"),
            num_kv_heads=need("num_key_value_heads"),
            head_dim=need("head_dim"),
            linear_num_key_heads=need("linear_num_key_heads"),
            linear_num_value_heads=need("linear_num_value_heads"),
            linear_key_head_dim=need("linear_key_head_dim"),
            linear_value_head_dim=need("linear_value_head_dim"),
            moe=moe,
            linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
            full_attention_interval=interval,
            rms_norm_eps=text.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", 1e7)),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.25)),
            mrope_section=tuple(rope.get("mrope_section", (11, 11, 10))),
            max_position_embeddings=text.get("max_position_embeddings", 262144),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
        )
        if moe:
            kw.update(
                num_experts=need("num_experts"),
                num_experts_per_tok=need("num_experts_per_tok"),
                moe_intermediate_size=need("moe_intermediate_size"),
                shared_expert_intermediate_size=need("shared_expert_intermediate_size"),
            )
        else:
            kw["intermediate_size"] = need("intermediate_size")
        vc = cfg.get("vision_config")
        if vc:
            kw["vision"] = VisionDims(
                depth=vc["depth"],
                hidden_size=vc["hidden_size"],
                num_heads=vc["num_heads"],
                intermediate_size=vc["intermediate_size"],
                out_hidden_size=vc["out_hidden_size"],
                patch_size=vc.get("patch_size", 16),
                temporal_patch_size=vc.get("temporal_patch_size", 2),
                spatial_merge_size=vc.get("spatial_merge_size", 2),
                in_channels=vc.get("in_channels", 3),
                num_position_embeddings=vc.get("num_position_embeddings", 2304),
                hidden_act=vc.get("hidden_act", "gelu_pytorch_tanh"),
            )
        variant = cls(**kw)
        if layer_types is not None and tuple(layer_types) != variant.layer_types:
            raise ValueError(
                f"layer_types ({len(layer_types)} entries) do not match num_hidden_layers="
                f"{variant.num_layers} with the family's 3:1 pattern (full attention every {interval} layers)"
            )
        return variant

    def diff(self, other: Variant) -> list[str]:
        """Human-readable field differences, for mismatch messages."""
        a, b = self.dims(), other.dims()
        out = []
        for k in sorted(set(a) | set(b)):
            if a.get(k) != b.get(k):
                out.append(f"{k}: {a.get(k)!r} != {b.get(k)!r}")
        return out
