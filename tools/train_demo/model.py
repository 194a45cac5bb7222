"""Training forward of the Qwen3.6 family: a batch of fresh equal-length sequences, full-sequence, with MTP.

The inference forward (``ninfer.targets.qwen3_6.model.forward``) serves an engine: paged KV, GDN state
slots, ragged rows. Training needs none of that, only every position of B fresh sequences at once, so
this module re-composes the family's own pieces instead of re-deriving the math:

- the per-token parts are the family functions themselves (`attention_projection`, `gdn_projection`,
  `gdn_split_heads`, `gdn_output`, `mlp`, zero-centred `rms_norm`, `mrope_cos_sin`), applied to the
  batch flattened to ``[B*T, H]`` and read through the family's `ModelView` of the live parameters;
- only the sequence mixers differ in form: dense causal attention over each sequence
  (`torch.nn.functional.scaled_dot_product_attention`, the same softmax attention as the reference
  ``paged_attention``) and the GDN short conv + chunked gated delta rule from zero state, batched over
  sequences (the reference `ninfer.ops.gated_delta.chunk_gated_delta_rule`, or fla-core's Triton kernel
  of the same name on CUDA when installed).

tests/demo checks that these logits equal the inference forward's on the same weights (fp32, 1e-4).

MTP (vLLM ``qwen3_5_mtp`` layout): slot i takes ``fc(cat[norm_emb(embed(x_{i+1})), norm_hid(h_i)])``
with ``h_i`` the main model's final (post-norm) hidden state, runs the full-attention MTP layer at
position i, then ``mtp.norm`` and the shared ``lm_head``; its logits predict ``x_{i+2}``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.ops.attention import gated_attention_output
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating
from ninfer.ops.norm import rms_norm
from ninfer.ops.rope import mrope_cos_sin
from ninfer.targets.qwen3_6.model import (
    attention_projection,
    gdn_output,
    gdn_projection,
    gdn_split_heads,
    mlp,
)
from ninfer.targets.qwen3_6.variant import Variant
from ninfer.targets.qwen3_6.view import AttentionLayerView, DecoderLayerView, GdnLayerView, ModelView
from ninfer.targets.qwen3_6.weights import WeightSpec, weight_schema

Tensor = torch.Tensor
# (q, k [B,T,nv,dk], v [B,T,nv,dv], g, beta [B,T,nv] fp32) -> o [B,T,nv,dv]
GdnCore = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
GdnImpl = Literal["auto", "fla", "compiled", "reference"]

__all__ = [
    "DemoModel",
    "TrainOutput",
    "init_weights",
    "select_gdn_core",
    "reference_gdn_core",
    "train_forward",
    "causal_conv1d_batched",
]


# ---- GDN core: reference or fla ------------------------------------------------------------------


def reference_gdn_core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The family's reference chunked delta rule over a batch of sequences, zero initial state (fp32)."""
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    return o


def _fla_gdn_core(device: torch.device) -> GdnCore:
    """fla-core's Triton chunk_gated_delta_rule (same maths: l2-normed q/k, q scaled by dk^-0.5).

    Probed with one tiny forward + backward on ``device`` first: fla refuses some Triton / GPU pairs
    only in the backward pass (fla-core 0.6.0 with Triton 3.4-3.7.0 on Hopper raises there).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule

    def core(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        o, _ = fla_chunk_gated_delta_rule(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            g.float().contiguous(),
            beta.to(q.dtype).contiguous(),
            use_qk_l2norm_in_kernel=True,
        )
        return o

    probe = [
        torch.randn(1, 64, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3)
    ]
    gates = torch.rand(1, 64, 2, device=device).log_().requires_grad_()
    beta = torch.rand(1, 64, 2, device=device, dtype=torch.bfloat16).requires_grad_()
    core(*probe, gates, beta).float().sum().backward()
    return core


def _compiled_reference_core() -> GdnCore:
    """The reference core through torch.compile (fuses its elementwise work and the chunk loop)."""
    return torch.compile(reference_gdn_core, dynamic=False)


def select_gdn_core(impl: GdnImpl, device: torch.device) -> tuple[GdnCore, str]:
    """The GDN core to train with and its name.

    ``auto``: fla on CUDA when it imports and passes a backward probe, else the reference compiled with
    torch.compile on CUDA, else (CPU) the plain reference. ``fla`` / ``compiled`` / ``reference`` force one.
    """
    if impl == "reference" or (impl == "auto" and device.type != "cuda"):
        return reference_gdn_core, "reference"
    if impl == "compiled":
        return _compiled_reference_core(), "reference+torch.compile"
    try:
        return _fla_gdn_core(device), "fla"
    except Exception as e:  # noqa: BLE001 (an import or probe failure means: no usable fla here)
        if impl == "fla":
            raise RuntimeError(f"--gdn-impl fla, but fla-core is not usable: {e}") from e
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        print(f"fla-core not usable ({reason}); using the compiled reference GDN core", flush=True)
        return _compiled_reference_core(), "reference+torch.compile"


# ---- sequence mixers over [B, T] -----------------------------------------------------------------


def causal_conv1d_batched(x: Tensor, weight: Tensor) -> Tensor:
    """silu(depthwise causal conv) of x [B, T, C] from zero history, weight [C, K]; fp32 math, x's dtype.

    The batched form of `ninfer.ops.conv.causal_conv1d` with no initial state (autocast is switched off
    so the conv runs in fp32 as the reference does).
    """
    kernel = weight.shape[-1]
    with torch.autocast(device_type=x.device.type, enabled=False):
        padded = F.pad(x.transpose(1, 2).float(), (kernel - 1, 0))  # [B, C, K-1+T]
        out = F.conv1d(padded, weight.float().unsqueeze(1), groups=weight.shape[0])
        return F.silu(out).transpose(1, 2).to(x.dtype)


def _attention_block(
    w: AttentionLayerView, variant: Variant, x: Tensor, batch: int, cos: Tensor, sin: Tensor
) -> Tensor:
    """Gated attention over [B*T, H] tokens of B causal sequences -> [B*T, H]."""
    n = x.shape[0]
    seq = n // batch
    q, gate, k, v = attention_projection(w, variant, x, cos, sin)  # [N, nH, D], [N, nH*D], [N, nKV, D]
    group = variant.num_attention_heads // variant.num_kv_heads

    def heads_first(t: Tensor) -> Tensor:  # [N, h, D] -> [B, h, T, D]
        return t.view(batch, seq, t.shape[1], t.shape[2]).transpose(1, 2)

    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1).to(q.dtype)
    o = F.scaled_dot_product_attention(
        heads_first(q), heads_first(k), heads_first(v), is_causal=True, scale=variant.head_dim**-0.5
    )
    o = o.transpose(1, 2).reshape(n, variant.num_attention_heads, variant.head_dim)
    return F.linear(gated_attention_output(o, gate), w.o_proj)


def _gdn_block(w: GdnLayerView, variant: Variant, x: Tensor, batch: int, gdn_core: GdnCore) -> Tensor:
    """Gated DeltaNet over [B*T, H] tokens of B sequences starting from zero state -> [B*T, H]."""
    n = x.shape[0]
    seq = n // batch
    mixed_qkv, z, a, b = gdn_projection(w, x)
    g, beta = gdn_gating(a, b, w.A_log, w.dt_bias)  # fp32 [N, nv]
    conv_out = causal_conv1d_batched(mixed_qkv.view(batch, seq, -1), w.conv_weight)
    q, k, v = gdn_split_heads(variant, conv_out)  # [B, T, nv, d]
    nv = variant.linear_num_value_heads
    o = gdn_core(q, k, v, g.view(batch, seq, nv), beta.view(batch, seq, nv))
    return gdn_output(w, variant, o.reshape(n, nv, variant.linear_value_head_dim), z)


def _decoder_layer(
    layer: DecoderLayerView,
    variant: Variant,
    x: Tensor,
    batch: int,
    cos: Tensor,
    sin: Tensor,
    gdn_core: GdnCore,
    dropout: float,
) -> Tensor:
    """Pre-norm residual layer (family `decoder_layer`), with optional training dropout on both branches."""
    eps = variant.rms_norm_eps
    mixer_in = rms_norm(x, layer.input_norm, eps)
    if isinstance(layer.mixer, GdnLayerView):
        mixed = _gdn_block(layer.mixer, variant, mixer_in, batch, gdn_core)
    else:
        mixed = _attention_block(layer.mixer, variant, mixer_in, batch, cos, sin)
    x = x + F.dropout(mixed, dropout, training=dropout > 0)
    out = mlp(layer.mlp, variant, rms_norm(x, layer.post_attention_norm, eps))
    return x + F.dropout(out, dropout, training=dropout > 0)


# ---- full forward --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TrainOutput:
    hidden: Tensor  # [B, T, H] main model after the final norm
    logits: Tensor  # [B, T, V] next-token logits (model dtype)
    mtp_logits: Tensor | None  # [B, T-1, V]: slot i predicts x_{i+2}; None when MTP is off


def train_forward(
    view: ModelView,
    variant: Variant,
    input_ids: Tensor,
    *,
    gdn_core: GdnCore = reference_gdn_core,
    with_mtp: bool = True,
    dropout: float = 0.0,
) -> TrainOutput:
    """Full-sequence forward of B fresh sequences ``input_ids`` [B, T] (positions 0..T-1)."""
    batch, seq = input_ids.shape
    text = view.text
    positions = torch.arange(seq, device=input_ids.device).expand(3, seq)
    cos_t, sin_t = mrope_cos_sin(positions, variant.rotary_dim, variant.rope_theta, variant.mrope_section)
    cos, sin = cos_t.repeat(batch, 1), sin_t.repeat(batch, 1)  # [B*T, rotary_dim], rows follow tokens

    x = F.dropout(F.embedding(input_ids.reshape(-1), text.embed), dropout, training=dropout > 0)
    for layer in text.layers:
        x = _decoder_layer(layer, variant, x, batch, cos, sin, gdn_core, dropout)
    hidden = rms_norm(x, text.norm, variant.rms_norm_eps)
    logits = F.linear(hidden, text.lm_head).view(batch, seq, -1)
    hidden = hidden.view(batch, seq, -1)

    mtp_logits = None
    if with_mtp and view.mtp is not None and seq > 1:
        mtp_logits = mtp_forward(view, variant, input_ids, hidden, cos_t, sin_t, gdn_core, dropout)
    return TrainOutput(hidden=hidden, logits=logits, mtp_logits=mtp_logits)


def mtp_forward(
    view: ModelView,
    variant: Variant,
    input_ids: Tensor,
    hidden: Tensor,
    cos_t: Tensor,
    sin_t: Tensor,
    gdn_core: GdnCore = reference_gdn_core,
    dropout: float = 0.0,
) -> Tensor:
    """MTP logits [B, T-1, V]: slot i = (embed(x_{i+1}), h_i) at position i, predicting x_{i+2}."""
    mtp = view.mtp
    assert mtp is not None
    batch, seq = input_ids.shape
    eps = variant.rms_norm_eps
    slots = seq - 1
    emb = F.embedding(input_ids[:, 1:].reshape(-1), view.text.embed)
    hid = hidden[:, :-1].reshape(batch * slots, -1)
    x = F.linear(
        torch.cat(
            (rms_norm(emb, mtp.pre_fc_norm_embedding, eps), rms_norm(hid, mtp.pre_fc_norm_hidden, eps)), -1
        ),
        mtp.fc,
    )
    cos, sin = cos_t[:slots].repeat(batch, 1), sin_t[:slots].repeat(batch, 1)
    for layer in mtp.layers:
        x = _decoder_layer(layer, variant, x, batch, cos, sin, gdn_core, dropout)
    x = rms_norm(x, mtp.norm, eps)
    return F.linear(x, view.text.lm_head).view(batch, slots, -1)


# ---- parameters ----------------------------------------------------------------------------------


_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")


def _init_tensor(spec: WeightSpec, variant: Variant, generator: torch.Generator, std: float) -> Tensor:
    """GPT-style init in the family's parameterisation (zero-centred norms start at 0, i.e. scale 1)."""
    name, shape = spec.name, spec.shape
    if name.endswith("A_log"):  # decay rate A in [1, 16], as HF/FLA draw it (minus the never-decaying tail)
        return torch.empty(shape).uniform_(1.0, 16.0, generator=generator).log_()
    if name.endswith("dt_bias"):  # Mamba dt init: dt log-uniform in [1e-3, 1e-1], stored as softplus^-1(dt)
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=generator).exp_()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("linear_attn.norm.weight"):  # the one plain (not zero-centred) norm weight
        return torch.ones(shape)
    if name.endswith(("norm.weight", "layernorm.weight")):
        return torch.zeros(shape)
    if name.endswith("conv1d.weight"):  # PyTorch Conv1d default: U(-1/sqrt(K), 1/sqrt(K))
        bound = shape[-1] ** -0.5
        return torch.empty(shape).uniform_(-bound, bound, generator=generator)
    if name.endswith(_OUTPUT_PROJECTIONS):  # residual-branch outputs scaled down by depth (GPT-2)
        depth = variant.num_layers + variant.mtp_num_hidden_layers
        return torch.empty(shape).normal_(0.0, std / math.sqrt(2 * depth), generator=generator)
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def init_weights(variant: Variant, seed: int, std: float = 0.02) -> dict[str, Tensor]:
    """Fresh fp32 weights of every schema tensor, drawn on CPU in schema order (seed-reproducible)."""
    generator = torch.Generator().manual_seed(seed)
    return {spec.name: _init_tensor(spec, variant, generator, std) for spec in weight_schema(variant)}


def _key(name: str) -> str:
    return name.replace(".", "__")  # ParameterDict keys cannot hold dots


class DemoModel(nn.Module):
    """The package's weights as trainable parameters, readable as the family's `ModelView`."""

    def __init__(self, variant: Variant, tensors: Mapping[str, Tensor]) -> None:
        super().__init__()
        self.variant = variant
        self.names = [spec.name for spec in weight_schema(variant)]
        missing = [n for n in self.names if n not in tensors]
        if missing:
            raise ValueError(f"missing tensors: {', '.join(missing)}")
        self.weights = nn.ParameterDict(
            {_key(n): nn.Parameter(tensors[n].detach().clone().float()) for n in self.names}
        )

    @classmethod
    def fresh(cls, variant: Variant, seed: int) -> DemoModel:
        return cls(variant, init_weights(variant, seed))

    def tensors(self) -> dict[str, Tensor]:
        """Schema name -> live parameter (no copies: gradients flow through views built on these)."""
        return {n: self.weights[_key(n)] for n in self.names}

    def view(self) -> ModelView:
        return ModelView.from_tensors(self.variant, self.tensors())

    def forward(
        self,
        input_ids: Tensor,
        *,
        gdn_core: GdnCore = reference_gdn_core,
        with_mtp: bool = True,
        dropout: float = 0.0,
    ) -> TrainOutput:
        return train_forward(
            self.view(), self.variant, input_ids, gdn_core=gdn_core, with_mtp=with_mtp, dropout=dropout
        )

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
