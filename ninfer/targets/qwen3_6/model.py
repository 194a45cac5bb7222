"""The Qwen3.6 text forward over explicit state: one flattened token batch of B rows at any positions.

The caller (the Program) owns all state and says, as plain tensor data, where each row reads and
writes it: GDN state slots (``state_in`` / ``state_out`` / ``fresh``) and KV pages (``block_table`` /
``slot_mapping``). The same `forward` serves prefill, chunked prefill, mixed steps and decode:

- Attention is varlen over the flattened batch (paged KV), so it never loops over rows here.
- Gated DeltaNet is per sequence: when rows have any lengths (prefill / mixed steps) it loops over rows
  (causal conv + chunked delta rule, or the one-token step for 1-token rows). When every row has the
  same number T of tokens (``tokens_per_row``: decode T = 1, a speculative verify T = K + 1) it runs one
  batched path with no Python loop over rows and no host sync: state slots are gathered, stepped (T
  times) and scattered as tensors, the state after each token optionally kept in its own slot, and
  attention (one query per token, each with its own context length) and MoE take their static-shape
  kernels, so a CUDA graph per (B, T) can capture it.
- Inputs are token embeddings, some of them replaced by spliced embeddings (image features); hidden
  states of chosen layers can be tapped (a drafter's conditioning).

GDN state reads all happen before writes (gather, compute, scatter), so a row may write its state back
into the slot it read (``state_out == state_in``). Distinct rows must write distinct slots.

Math: shared/reference/qwen3_6-architecture.md section 2; oracle: transformers'
``Qwen3_5(Moe)ForCausalLM`` (tests/model).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from ninfer.targets.qwen3_6.kernels import REFERENCE, Kernels, gdn_in_projection, gdn_split_heads, qkv_heads
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
    "mtp_forward",
    "step_logits",
    "attention_mixer",
    "attention_qkv",
    "attention_projection",
    "attention_activation",
    "gdn_mixer",
    "gdn_activation",
    "gdn_gated_norm",
    "gdn_projection",
    "gdn_split_heads",
    "gdn_output",
    "mlp",
    "dense_mlp_activation",
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

    @classmethod
    def allocate_kv(
        cls, variant: Variant, layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
        device: torch.device | str, head_shape: tuple[int, int] | None = None,
    ) -> StateStore:  # fmt: skip
        """KV pages only, for ``layers`` attention layers outside the text model (a drafter's, e.g. the
        MTP layer): the same page ids and layout as the text model's pool, no GDN slots; ``head_shape``:
        their (KV heads, head dim) when not the text model's (a DFlash drafter's)."""
        heads, head_dim = head_shape or (variant.num_kv_heads, variant.head_dim)
        kv_shape = (layers, num_pages, page_size, heads, head_dim)
        empty = torch.zeros(0, device=device)
        return cls(
            conv=empty, rec=empty, k_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
            v_pages=torch.zeros(kv_shape, dtype=dtype, device=device),
        )  # fmt: skip

    @staticmethod
    def slot_bytes(variant: Variant, dtype: torch.dtype) -> int:
        """Bytes of one StateImage slot: every GDN layer's conv window and fp32 recurrent state."""
        elem = torch.empty((), dtype=dtype).element_size()
        conv = variant.conv_dim * (variant.linear_conv_kernel_dim - 1) * elem
        rec = variant.linear_num_value_heads * variant.linear_key_head_dim * variant.linear_value_head_dim * 4
        return len(variant.gdn_layers) * (conv + rec)

    @staticmethod
    def page_bytes(
        variant: Variant, page_size: int, dtype: torch.dtype, extra_layers: int = 0,
        extra_head_shape: tuple[int, int] | None = None,
    ) -> int:  # fmt: skip
        """Bytes of one KV page id: K and V of ``page_size`` positions in every attention layer (and
        ``extra_layers`` more: a drafter's, which use the same page ids, of ``extra_head_shape`` (KV
        heads, head dim) when not the text model's)."""
        elem = torch.empty((), dtype=dtype).element_size()
        width = variant.num_kv_heads * variant.head_dim
        heads, head_dim = extra_head_shape or (variant.num_kv_heads, variant.head_dim)
        per_position = len(variant.attention_layers) * width + extra_layers * heads * head_dim
        return 2 * page_size * per_position * elem

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
    state_out     [B] long        GDN slot each row writes its final state to (may equal state_in), or
                  [B, T] long     with T tokens per row: the slot of the state after each token (a
                                  speculative verify's per-position states; they differ from state_in)
    fresh         [B] bool        the row starts from zero GDN state instead of reading state_in
    tokens_per_row                T when every row has exactly T tokens (the static-shape path a CUDA
                                  graph captures: decode T = 1, a verify T = K + 1), None for rows of
                                  any length (prefill); derived from the shapes when not given (1 when
                                  N == B, else None)
    splice_index  [M] long | None token positions whose input embedding comes from ``splice_embeds``
    splice_embeds [M, H] | None   instead of the token embedding (image features at their pad tokens)
    splice_mask   [N] bool | None the dense form, in place of splice_index (a prefill graph's static
                                  buffers): with splice_embeds [N, H], a token whose mask is set takes
                                  its row of splice_embeds
    inputs_embeds [N, H] | None   replaces every token embedding (tests, the demo trainer)
    taps          layer indices whose output the forward returns (transformers' ``hidden_states[i + 1]``:
                  the residual stream after the layer; after the last, the final norm's output)
    query_start_host              query_start as host ints (prefill paths read row bounds from it)
    context_lens_host             context_lens as host ints (the SDPA prefill baseline reads them)
    padded                        the token tensors are a prefill graph's capacity: one row whose tokens
                                  from query_start[-1] (on the device) on are padding: their KV slot is
                                  -1, the GDN state is the state after the last real token, and every op
                                  leaves them finite (they are never read back); the host bounds are the
                                  capacity's
    memo                          values an op makes once per step for all its layers (fla's varlen chunk
                                  table), functions of the step's host facts only; never copied by
                                  `dataclasses.replace`

    The host copies let the prefill ops size their launches without reading the device tensors back: such a
    read is a host sync that drains the GPU queue, and the host then trails the GPU for the rest of the step.
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
    tokens_per_row: int | None = None
    splice_index: Tensor | None = None
    splice_embeds: Tensor | None = None
    splice_mask: Tensor | None = None
    inputs_embeds: Tensor | None = None
    taps: tuple[int, ...] = field(default=())
    query_start_host: tuple[int, ...] | None = None  # query_start on the host, when the builder knows it
    context_lens_host: tuple[int, ...] | None = None  # context_lens on the host, when the builder knows it
    padded: bool = False
    memo: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tokens, rows = self.token_ids.shape[0], self.query_start.shape[0] - 1
        if self.tokens_per_row is None and tokens == rows:
            object.__setattr__(self, "tokens_per_row", 1)
        elif self.tokens_per_row is not None and tokens != rows * self.tokens_per_row:
            raise ValueError(f"{tokens} tokens are not {rows} rows of {self.tokens_per_row}")
        if (self.splice_index is None and self.splice_mask is None) != (self.splice_embeds is None):
            raise ValueError("splice_embeds comes with one of splice_index and splice_mask")
        if self.splice_index is not None and self.splice_mask is not None:
            raise ValueError("splice_index and splice_mask are two forms of one splice: give one")

    def query_bounds(self) -> list[int]:
        """query_start as host ints (a device sync only when the builder did not supply them)."""
        if self.query_start_host is not None:
            return list(self.query_start_host)
        return self.query_start.tolist()

    def context_lengths(self) -> list[int]:
        """context_lens as host ints (a device sync only when the builder did not supply them)."""
        if self.context_lens_host is not None:
            return list(self.context_lens_host)
        return self.context_lens.tolist()

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def num_rows(self) -> int:
        return self.query_start.shape[0] - 1

    @property
    def uniform(self) -> bool:
        """Every row has exactly ``tokens_per_row`` tokens: the static-shape, graph-capturable path."""
        return self.tokens_per_row is not None

    @property
    def is_decode(self) -> bool:
        """Every row has exactly one token; decided from shapes only (no host sync)."""
        return self.tokens_per_row == 1

    @functools.cached_property
    def query_tables(self) -> tuple[Tensor, Tensor]:
        """(block_table [N, maxp], context_lens [N]) with one row per query token of a uniform step: query t
        of a row of T sees the row's context up to its own position (context_lens[r] - T + 1 + t). For
        T = 1 these are the rows' own tensors. Device ops only (graph-capturable), made once per step."""
        tokens = self.tokens_per_row
        if tokens is None:
            raise ValueError("per-query tables exist for uniform steps only")
        if tokens == 1:
            return self.block_table, self.context_lens
        offsets = torch.arange(1 - tokens, 1, device=self.context_lens.device, dtype=self.context_lens.dtype)
        lens = (self.context_lens.unsqueeze(1) + offsets).flatten()
        return self.block_table.repeat_interleave(tokens, dim=0), lens


@dataclass(frozen=True, eq=False)
class ForwardOutput:
    hidden: Tensor  # [N, H] after the final norm
    logits: Tensor | None  # fp32: [B, V] (each row's last token), [N, V], or None
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer -> [N, H] its output (`StepBatch.taps`)


# ---- forward -------------------------------------------------------------------------------------


def forward(
    view: ModelView,
    variant: Variant,
    batch: StepBatch,
    store: StateStore,
    *,
    logits: LogitsMode = "last",
    kernels: Kernels = REFERENCE,
) -> ForwardOutput:
    """Run the text model over ``batch``, reading and writing ``store`` in place.

    Each block's output projection, the residual add and the norm that follows are one op
    (``linear_add_rms_norm``; ``add_rms_norm`` after the MoE block): the stream ``x`` and the normed
    input ``h`` of the next block come out of it.
    """
    text = view.text
    if batch.inputs_embeds is not None:
        x = batch.inputs_embeds.to(text.embed.dtype)
    else:
        x = F.embedding(batch.token_ids, text.embed)
    if batch.splice_index is not None:
        assert batch.splice_embeds is not None
        x = x.index_copy(0, batch.splice_index, batch.splice_embeds.to(x.dtype))
    elif batch.splice_mask is not None:
        assert batch.splice_embeds is not None
        x = torch.where(batch.splice_mask[:, None], batch.splice_embeds.to(x.dtype), x)
    cos, sin = kernels.mrope_cos_sin(
        batch.positions, variant.rotary_dim, variant.rope_theta, variant.mrope_section
    )
    eps = variant.rms_norm_eps
    h = kernels.rms_norm(x, text.layers[0].input_norm, eps)
    taps: dict[int, Tensor] = {}
    for i, layer in enumerate(text.layers):
        following = text.layers[i + 1].input_norm if i + 1 < len(text.layers) else text.norm
        h, x = _layer_blocks(layer, variant, h, x, following, batch, store, cos, sin, kernels)
        if i in batch.taps:  # transformers' hidden_states[i + 1]: after the last layer, the final norm's
            taps[i] = h if i + 1 == len(text.layers) else x
    return ForwardOutput(hidden=h, logits=step_logits(view, batch, h, logits, kernels), taps=taps)


def step_logits(
    view: ModelView, batch: StepBatch, hidden: Tensor, logits: LogitsMode, kernels: Kernels = REFERENCE
) -> Tensor | None:
    """The fp32 logits `forward` returns for ``hidden`` [N, H] (after the final norm): each row's last
    token's, every token's, or None."""
    if logits == "none":
        return None
    if logits == "last":
        selected = _last_tokens(hidden, batch)
    elif logits == "all":
        selected = hidden
    else:
        raise ValueError(f"logits must be 'last', 'all' or 'none', not {logits!r}")
    return kernels.logits(selected, view.text.lm_head)


def _last_tokens(hidden: Tensor, batch: StepBatch) -> Tensor:
    """Each row's last token of ``hidden`` [N, H] -> [B, H] (one token per row: ``hidden`` itself, no
    gather launch; T per row: a strided view)."""
    tokens = batch.tokens_per_row
    if tokens == 1:
        return hidden
    if tokens is not None:
        return hidden[tokens - 1 :: tokens]
    return hidden.index_select(0, batch.query_start[1:].long() - 1)


def _layer_blocks(
    layer: DecoderLayerView,
    variant: Variant,
    h: Tensor,
    x: Tensor,
    following_norm: Tensor,
    batch: StepBatch,
    store: StateStore,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
) -> tuple[Tensor, Tensor]:
    """One decoder layer on the normed input ``h`` and stream ``x`` -> (next block's normed input, x)."""
    eps = variant.rms_norm_eps
    act, out_proj = _mixer_activation(layer, variant, h, batch, store, cos, sin, kernels)
    h, x = kernels.linear_add_rms_norm(act, out_proj, x, layer.post_attention_norm, eps)
    if isinstance(layer.mlp, MoeMlpView):
        mlp_out = kernels.moe_block(layer.mlp, variant, h, batch.uniform)
        return kernels.add_rms_norm(mlp_out, x, following_norm, eps)
    act = dense_mlp_activation(layer.mlp, h, kernels)
    return kernels.linear_add_rms_norm(act, layer.mlp.down_proj, x, following_norm, eps)


def _mixer_activation(
    layer: DecoderLayerView,
    variant: Variant,
    h: Tensor,
    batch: StepBatch,
    store: StateStore,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
) -> tuple[Tensor, Tensor]:
    """The mixer up to its output projection: (the projection's input, the projection weight)."""
    i, w = layer.state_index, layer.mixer
    if isinstance(w, GdnLayerView):
        return gdn_activation(w, variant, h, batch, store.conv[i], store.rec[i], kernels), w.out_proj
    act = attention_activation(w, variant, h, batch, store.k_pages[i], store.v_pages[i], cos, sin, kernels)
    return act, w.o_proj


def _mixer(
    layer: DecoderLayerView,
    variant: Variant,
    h: Tensor,
    batch: StepBatch,
    store: StateStore,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels,
) -> Tensor:
    i = layer.state_index
    if isinstance(layer.mixer, GdnLayerView):
        return gdn_mixer(layer.mixer, variant, h, batch, store.conv[i], store.rec[i], kernels)
    return attention_mixer(
        layer.mixer, variant, h, batch, store.k_pages[i], store.v_pages[i], cos, sin, kernels
    )


def decoder_layer(
    layer: DecoderLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    store: StateStore,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """Pre-norm residual layer on its own: ``x += mixer(norm(x)); x += mlp(norm(x))`` (MTP, tests)."""
    eps = variant.rms_norm_eps
    h = kernels.rms_norm(x, layer.input_norm, eps)
    mixed = _mixer(layer, variant, h, batch, store, cos, sin, kernels)
    h, x = kernels.add_rms_norm(mixed, x, layer.post_attention_norm, eps)
    return x + mlp(layer.mlp, variant, h, decode=batch.uniform, kernels=kernels)


def mtp_forward(
    view: ModelView,
    variant: Variant,
    token_ids: Tensor,
    hidden: Tensor,
    batch: StepBatch,
    store: StateStore,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """The MTP block over ``batch``'s layout: token i's input is ``fc([norm_e(embed(token_ids[i]));
    norm_h(hidden[i])])`` (the embedding first), where ``hidden[i]`` is the text model's final-norm
    hidden state at token i's position (or, chaining, the MTP's own previous output) and
    ``token_ids[i]`` the token after that position; then the MTP layer(s) at those positions with their
    own KV in ``store`` (`StateStore.allocate_kv`), then ``mtp.norm``. Returns that normed output
    [N, H]: the next chain step's ``hidden``, and through ``lm_head`` the logits of the token after
    ``token_ids[i]``. Math: shared/reference/speculative-decoding.md section 4."""
    mtp = view.mtp
    if mtp is None:
        raise ValueError("this model has no MTP layer")
    eps = variant.rms_norm_eps
    emb = F.embedding(token_ids, view.text.embed)
    joined = torch.cat(
        (
            kernels.rms_norm(emb, mtp.pre_fc_norm_embedding, eps),
            kernels.rms_norm(hidden, mtp.pre_fc_norm_hidden, eps),
        ),
        dim=-1,
    )
    x = kernels.linear(joined, mtp.fc)
    cos, sin = kernels.mrope_cos_sin(
        batch.positions, variant.rotary_dim, variant.rope_theta, variant.mrope_section
    )
    for layer in mtp.layers:
        x = decoder_layer(layer, variant, x, batch, store, cos, sin, kernels)
    return kernels.rms_norm(x, mtp.norm, eps)


# ---- gated attention ----------------------------------------------------------------------------


def attention_qkv(w: AttentionLayerView, x: Tensor, kernels: Kernels = REFERENCE) -> Tensor:
    """x [N, H] -> qkv [N, nH*2D + 2*nKV*D]: the q projection (per-head [query | gate]), then k, then v."""
    linear = kernels.linear
    if w.qkv_proj is not None:  # one GEMM for the three projections
        return linear(x, w.qkv_proj)
    return torch.cat([linear(x, w.q_proj), linear(x, w.k_proj), linear(x, w.v_proj)], dim=-1)


def attention_projection(
    w: AttentionLayerView, variant: Variant, x: Tensor, cos: Tensor, sin: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> q [N, nH, D] (normed, roped), gate [N, nH*D], k [N, nKV, D] (normed, roped), v: the
    reference ops, differentiable (the demo-model trainer uses it)."""
    return qkv_heads(attention_qkv(w, x), w.q_norm, w.k_norm, cos, sin, variant)


def attention_mixer(
    w: AttentionLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    k_pages: Tensor,
    v_pages: Tensor,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """Gated attention over the paged KV of this layer (writes the new tokens' K/V first) -> [N, H]."""
    act = attention_activation(w, variant, x, batch, k_pages, v_pages, cos, sin, kernels)
    return kernels.linear(act, w.o_proj)


def attention_activation(
    w: AttentionLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    k_pages: Tensor,
    v_pages: Tensor,
    cos: Tensor,
    sin: Tensor,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """`attention_mixer` up to o_proj: the gated attention output [N, nH*D].

    The prologue normalises and ropes q and k and writes k and v into their slots; the output gate
    reads its columns of qkv in place, inside the attention op (decode or prefill), where its output is
    written.
    """
    qkv = attention_qkv(w, x, kernels)
    q = kernels.attention_prologue(
        qkv, w.q_norm, w.k_norm, cos, sin, k_pages, v_pages, batch.slot_mapping, variant
    )
    scale = variant.head_dim**-0.5
    if batch.uniform:  # the graph-capturable kernel (no host sync), gate included: one query per table row
        block_table, context_lens = batch.query_tables
        return kernels.gated_decode_attention(
            q, k_pages, v_pages, block_table, context_lens, scale, qkv, batch.tokens_per_row or 1
        )
    return kernels.gated_prefill_attention(q, k_pages, v_pages, batch, scale, qkv)


# ---- Gated DeltaNet -----------------------------------------------------------------------------


def gdn_projection(
    w: GdnLayerView, x: Tensor, kernels: Kernels = REFERENCE
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """x [N, H] -> mixed_qkv [N, conv_dim] (to be convolved), z [N, value_dim], a [N, nv], b [N, nv]."""
    return gdn_in_projection(w, x, kernels.linear)


def gdn_output(
    w: GdnLayerView, variant: Variant, o: Tensor, z: Tensor, kernels: Kernels = REFERENCE
) -> Tensor:
    """Delta-rule output o [N, nv, dv] (fp32 or model dtype) -> gated norm with silu(z) -> out_proj."""
    return kernels.linear(gdn_gated_norm(w, variant, o, z, kernels), w.out_proj)


def gdn_gated_norm(
    w: GdnLayerView, variant: Variant, o: Tensor, z: Tensor, kernels: Kernels = REFERENCE
) -> Tensor:
    """`gdn_output` up to out_proj: the gated norm with silu(z), [N, nv*dv] in the model dtype."""
    n, nv, dv = o.shape
    # the norm casts o to the model dtype first, as HF does (the fast kernel folds that cast in)
    normed = kernels.gated_rms_norm(o, w.norm, z.reshape(n, nv, dv), variant.rms_norm_eps)
    return normed.reshape(n, nv * dv)


def gdn_mixer(
    w: GdnLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    conv_slots: Tensor,
    rec_slots: Tensor,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """Gated DeltaNet over the batch; reads each row's state slot, writes its final state slot.

    conv_slots [S, conv_dim, K-1] and rec_slots [S, nv, dk, dv] are this layer's slices of the store.
    """
    return kernels.linear(gdn_activation(w, variant, x, batch, conv_slots, rec_slots, kernels), w.out_proj)


def gdn_activation(
    w: GdnLayerView,
    variant: Variant,
    x: Tensor,
    batch: StepBatch,
    conv_slots: Tensor,
    rec_slots: Tensor,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """`gdn_mixer` up to out_proj: the gated norm output [N, nv*dv].

    Uniform steps take the layer input whole, so that the fast table can run the conv step inside the
    input projection's epilogue."""
    if batch.uniform:
        o, z = kernels.gdn_decode(w, variant, x, conv_slots, rec_slots, batch)
    else:
        mixed_qkv, z, a, b = gdn_projection(w, x, kernels)
        o = kernels.gdn_prefill(w, variant, mixed_qkv, a, b, conv_slots, rec_slots, batch)
    return gdn_gated_norm(w, variant, o, z, kernels)


# ---- MLP ------------------------------------------------------------------------------------------


def mlp(
    w: DenseMlpView | MoeMlpView,
    variant: Variant,
    x: Tensor,
    *,
    decode: bool = False,
    kernels: Kernels = REFERENCE,
) -> Tensor:
    """Post-mixer MLP: dense SwiGLU, or routed experts plus the sigmoid-gated shared expert.

    ``decode`` (a few tokens, one per row) asks the MoE experts for their static-shape, no-sync form.
    """
    if isinstance(w, MoeMlpView):
        return kernels.moe_block(w, variant, x, decode)
    return kernels.linear(dense_mlp_activation(w, x, kernels), w.down_proj)


def dense_mlp_activation(w: DenseMlpView, x: Tensor, kernels: Kernels = REFERENCE) -> Tensor:
    """The dense SwiGLU MLP up to down_proj: silu(gate) * up [N, I]."""
    linear = kernels.linear
    if w.gate_up_proj is not None:
        gate, up = linear(x, w.gate_up_proj).chunk(2, dim=-1)
    else:
        gate, up = linear(x, w.gate_proj), linear(x, w.up_proj)
    return kernels.swiglu(gate, up)
