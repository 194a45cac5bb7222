"""Reference gated GQA attention of Qwen3.6 (plain PyTorch, fp32 softmax, differentiable).

Flattened-token layout: q [N, nH, D], k/v [N, nKV, D]; query head h reads kv head h // (nH / nKV).
The paged KV store is [P, page_size, nKV, D] per layer; token slot s lives at page s // page_size,
offset s % page_size. The reference paged attention gathers a row's pages and runs dense masked
softmax, so it is the oracle for any fast paged kernel.

The attention layer's step ops, reference and fast side by side (the fast op table's entries):

- `attention_prologue`: the stacked qkv projection's output -> q (normed, roped); k (normed, roped) and v
  written into their KV slots. Fast: `ninfer.ops.triton.attention_prologue.qk_norm_rope_kv_write`, one
  launch (about ten before).
- `gated_decode_attention`: one query per table row over the paged K/V, then the output gate read from
  qkv's gate columns. Fast: `ninfer.ops.triton.paged_decode_attention` (split-KV, GQA packed) with the gate
  applied where the output is written, one launch fewer per layer.
- `paged_block_attention`: a DFlash drafter's block of T queries a row over its paged context, causal or
  not, in a window or not. Fast: `fast_paged_block_attention`, the prefill kernel below with those masks.
- `gated_prefill_attention`: rows of any length, then the output gate. Fast:
  `ninfer.ops.triton.paged_prefill_attention` (flash-style, pages and GQA read in place, row bounds and
  lengths read on the device, so it is captured inside the prefill graphs) with the gate applied where
  the output is written. `sdpa_prefill_attention`, per row one `F.scaled_dot_product_attention` over the
  row's gathered and head-repeated pages, is what it replaced: kept as its measured baseline
  (`tools/prefill_attention_probe`) and a second oracle of its GPU test.

The fast forms take their PDL flags from `ninfer.ops.pdl_policy`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.ops.norm import rms_norm
from ninfer.ops.pdl_policy import pdl_policy
from ninfer.ops.rope import apply_partial_rope
from ninfer.ops.step import StepFacts

__all__ = [
    "split_q_gate",
    "causal_attention",
    "kv_write",
    "paged_attention",
    "paged_block_attention",
    "fast_paged_block_attention",
    "gated_attention_output",
    "paged_decode_attention",
    "AttentionHeads",
    "qkv_heads",
    "attention_prologue",
    "fast_attention_prologue",
    "gated_output",
    "gated_decode_attention",
    "fast_gated_decode_attention",
    "gated_prefill_attention",
    "fast_gated_prefill_attention",
    "sdpa_prefill_attention",
]

Tensor = torch.Tensor


def split_q_gate(q_proj_out: torch.Tensor, n_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split q_proj's output [N, nH*2*D] into q [N, nH, D] and gate [N, nH*D].

    The layout is interleaved per head (query D dims then gate D dims for each head), not two halves.
    """
    per_head = q_proj_out.reshape(q_proj_out.shape[0], n_heads, 2 * head_dim)
    query = per_head[..., :head_dim]
    gate = per_head[..., head_dim:].reshape(q_proj_out.shape[0], n_heads * head_dim)
    return query, gate


def _attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, q_positions: torch.Tensor
) -> torch.Tensor:
    """fp32 masked softmax attention: query i sees keys 0..q_positions[i]. q [M, nH, D], k/v [L, nKV, D]."""
    n_heads, n_kv = q.shape[1], k.shape[1]
    group = n_heads // n_kv
    q32 = q.float().transpose(0, 1)  # [nH, M, D]
    k32 = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [nH, L, D]
    v32 = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q32 @ k32.transpose(-1, -2)) * scale  # [nH, M, L]
    key_positions = torch.arange(k.shape[0], device=q.device)
    visible = key_positions.unsqueeze(0) <= q_positions.unsqueeze(1)  # [M, L]
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return (probs @ v32).transpose(0, 1).to(q.dtype)  # [M, nH, D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal GQA attention over one sequence: q [N, nH, D], k/v [N, nKV, D] -> [N, nH, D]."""
    return _attend(q, k, v, scale, torch.arange(q.shape[0], device=q.device))


def kv_write(
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write token n's k[n]/v[n] [nKV, D] into flat slot slot_mapping[n] of pages [P, page_size, nKV, D].

    In place; slots must be valid (no padding slots) and distinct.
    """
    slots = slot_mapping.long()
    k_pages.view(-1, *k_pages.shape[2:]).index_copy_(0, slots, k.to(k_pages.dtype))
    v_pages.view(-1, *v_pages.shape[2:]).index_copy_(0, slots, v.to(v_pages.dtype))


def paged_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Varlen paged causal attention over B rows -> [N, nH, D].

    Row r's queries q[query_start[r]:query_start[r+1]] are the last tokens of a context of
    context_lens[r] tokens whose K/V (the queries' own included) are in pages block_table[r]; each query
    sees the context up to and including its own position.
    """
    page_size = k_pages.shape[1]
    out = torch.zeros_like(q)  # tokens outside every row (padding) read as zeros
    starts = query_start.tolist()  # host sync: fine for the reference, a fast kernel reads them on device
    lengths = context_lens.tolist()
    for row, context_len in enumerate(lengths):
        q_row = q[starts[row] : starts[row + 1]]
        n_queries = q_row.shape[0]
        if n_queries == 0:
            continue
        if n_queries > context_len:
            raise ValueError(f"row {row}: {n_queries} queries exceed context length {context_len}")
        n_pages = -(-context_len // page_size)
        pages = block_table[row, :n_pages].long()
        k_ctx = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:context_len]
        v_ctx = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:context_len]
        q_positions = torch.arange(context_len - n_queries, context_len, device=q.device)
        out[starts[row] : starts[row + 1]] = _attend(q_row, k_ctx, v_ctx, scale, q_positions)
    return out


def paged_block_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    causal: bool,
    window: int | None = None,
) -> torch.Tensor:
    """A DFlash drafter's attention: B rows of T queries each (q [B*T, nH, D]), the last T positions of
    a context of context_lens[r] tokens whose K/V (the queries' own included) are in pages
    block_table[r]. Without ``causal`` a query sees the whole context, the block's later positions
    included; with it, keys up to its own position. ``window``: only keys less than ``window`` positions
    away (before it; and after it, when not causal). fp32 math -> [B*T, nH, D]."""
    rows = context_lens.shape[0]
    tokens = q.shape[0] // rows
    page_size = k_pages.shape[1]
    out = torch.empty_like(q)
    lengths = context_lens.tolist()  # host sync: fine for the reference
    for row, context_len in enumerate(lengths):
        n_pages = -(-context_len // page_size)
        pages = block_table[row, :n_pages].long()
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:context_len]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:context_len]
        q_row = q[row * tokens : (row + 1) * tokens]
        group = q.shape[1] // k.shape[1]
        q32 = q_row.float().transpose(0, 1)  # [nH, T, D]
        k32 = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
        v32 = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (q32 @ k32.transpose(-1, -2)) * scale  # [nH, T, L]
        query_pos = torch.arange(context_len - tokens, context_len, device=q.device)[:, None]
        key_pos = torch.arange(context_len, device=q.device)[None, :]
        visible = torch.ones(tokens, context_len, dtype=torch.bool, device=q.device)
        if causal:
            visible &= key_pos <= query_pos
        if window is not None:
            visible &= query_pos - key_pos < window
            if not causal:
                visible &= key_pos - query_pos < window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[row * tokens : (row + 1) * tokens] = (torch.softmax(scores, -1) @ v32).transpose(0, 1).to(q.dtype)
    return out


def gated_attention_output(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output gate: o [N, nH, D] flattened to [N, nH*D] times sigmoid(gate), fp32 math."""
    flat = o.flatten(1)
    return (flat.float() * torch.sigmoid(gate.float())).to(o.dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention` for one query per row (decode), with no host sync: graph-capturable.

    q [B, nH, D]; row r's query is the last of context_lens[r] positions held in block_table[r]. Every
    row gathers all ``max_pages`` table entries (a static shape) and masks positions past its length,
    so the cost follows the table width, not the live lengths: a reference, not a fast kernel.
    """
    b, n_heads, _ = q.shape
    n_kv = k_pages.shape[2]
    pages = block_table.long()
    k = k_pages[pages].reshape(b, -1, n_kv, k_pages.shape[-1])  # [B, L, nKV, D]
    v = v_pages[pages].reshape(b, -1, n_kv, v_pages.shape[-1])
    group = n_heads // n_kv
    q32 = q.float().view(b, n_kv, group, -1)  # query head j uses kv head j // group
    scores = torch.einsum("bkgd,blkd->bkgl", q32, k.float()) * scale  # [B, nKV, group, L]
    visible = torch.arange(k.shape[1], device=q.device).unsqueeze(0) < context_lens.unsqueeze(1)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, v.float())
    return out.reshape(b, n_heads, -1).to(q.dtype)


# ---- the attention layer's step ops ---------------------------------------------------------------


@dataclass(frozen=True)
class AttentionHeads:
    """The head layout of a gated attention layer and its q/k norms' eps."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def qkv_heads(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, heads: AttentionHeads
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """qkv [N, nH*2D + 2*nKV*D] -> q [N, nH, D] (normed, roped), gate [N, nH*D], k [N, nKV, D] (normed,
    roped), v [N, nKV, D]: the reference composition (differentiable)."""
    n, d = qkv.shape[0], heads.head_dim
    kv_dim = heads.num_kv_heads * d
    q_out, k, v = qkv.split([heads.num_heads * 2 * d, kv_dim, kv_dim], -1)
    q, gate = split_q_gate(q_out, heads.num_heads, d)
    q = apply_partial_rope(rms_norm(q, q_norm, heads.eps), cos, sin)
    k = apply_partial_rope(rms_norm(k.reshape(n, heads.num_kv_heads, d), k_norm, heads.eps), cos, sin)
    return q, gate, k, v.reshape(n, heads.num_kv_heads, d)


def attention_prologue(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, k_pages: Tensor, v_pages: Tensor,
    slot_mapping: Tensor, heads: AttentionHeads,
) -> Tensor:  # fmt: skip
    """q [N, nH, D] normed and roped; k normed and roped, and v, written into their KV slots."""
    q, _, k, v = qkv_heads(qkv, q_norm, k_norm, cos, sin, heads)
    kv_write(k_pages, v_pages, k, v, slot_mapping)
    return q


def fast_attention_prologue(
    qkv: Tensor, q_norm: Tensor, k_norm: Tensor, cos: Tensor, sin: Tensor, k_pages: Tensor, v_pages: Tensor,
    slot_mapping: Tensor, heads: AttentionHeads,
) -> Tensor:  # fmt: skip
    """`attention_prologue` in one launch; the KV slots (a step input) load before the PDL wait."""
    from ninfer.ops.triton.attention_prologue import qk_norm_rope_kv_write

    policy = pdl_policy(qkv.shape[0])
    return qk_norm_rope_kv_write(
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping,
        num_heads=heads.num_heads, num_kv_heads=heads.num_kv_heads, head_dim=heads.head_dim, eps=heads.eps,
        settled=policy.settled, launch_next_early=policy.launch_next_early,
    )  # fmt: skip


def gated_output(o: Tensor, qkv: Tensor) -> Tensor:
    """o [N, nH, D] times sigmoid of its gate columns in qkv (the interleaved q projection comes first)."""
    _, n_heads, dim = o.shape
    return gated_attention_output(o, split_q_gate(qkv[:, : n_heads * 2 * dim], n_heads, dim)[1])


def gated_decode_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, context_lens: Tensor, scale: float,
    qkv: Tensor, tokens_per_row: int,
) -> Tensor:  # fmt: skip
    """One query per table row (row q sees its context_lens[q] positions), then the output gate read from
    qkv -> [N, nH*D]; the step wrote the last tokens_per_row positions of each row's run of queries."""
    return gated_output(paged_decode_attention(q, k_pages, v_pages, block_table, context_lens, scale), qkv)


def fast_gated_decode_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, context_lens: Tensor, scale: float,
    qkv: Tensor, tokens_per_row: int,
) -> Tensor:  # fmt: skip
    """The output gate applied where the attention's output is written (the merge of the split-KV
    partials, or the single-split kernel): one dependent launch fewer per attention layer than attention
    + `sigmoid_gate`. Its early K/V loads (`pdl_policy`'s ``settled_kv``) assume the step wrote only each
    query's newest position, so a step of several tokens per row loads nothing before its wait."""
    from ninfer.ops.triton.paged_decode_attention import paged_decode_attention as triton_decode_attention

    policy = pdl_policy(q.shape[0], tokens_per_row)
    o = triton_decode_attention(
        q, k_pages, v_pages, block_table, context_lens, scale,
        launch_next_early=policy.launch_next_early, gate_qkv=qkv, settled=policy.settled_kv,
    )  # fmt: skip
    return o.flatten(1)


def gated_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, step: StepFacts, scale: float, qkv: Tensor
) -> Tensor:
    """`paged_attention` over the step's rows, then the output gate read from qkv -> [N, nH*D] (tokens
    past the rows, a prefill graph's padding, read as zeros)."""
    o = paged_attention(q, k_pages, v_pages, step.block_table, step.query_start, step.context_lens, scale)
    return gated_output(o, qkv)


def fast_gated_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, step: StepFacts, scale: float, qkv: Tensor
) -> Tensor:
    """The Triton kernel, the gate applied where it writes; row bounds and lengths read on the device
    (graph-capturable); a padded step's padding tokens are written as zeros."""
    from ninfer.ops.triton.paged_prefill_attention import paged_prefill_attention

    return paged_prefill_attention(
        q, k_pages, v_pages, step.block_table, step.query_start, step.context_lens, scale, gate_qkv=qkv,
        zero_padding=step.padded,
    )  # fmt: skip


def fast_paged_block_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_table: Tensor, context_lens: Tensor, scale: float,
    *, causal: bool, window: int | None = None,
) -> Tensor:  # fmt: skip
    """`paged_block_attention` by the Triton prefill kernel (rows of equal length, the block's visibility
    as its ``causal`` and ``window`` say): nothing read back to the host, so the drafter's round can be
    queued behind the verify, or captured."""
    from ninfer.ops.triton.paged_prefill_attention import paged_prefill_attention

    rows = context_lens.shape[0]
    query_start = torch.arange(0, q.shape[0] + 1, q.shape[0] // rows, dtype=torch.int32, device=q.device)
    return paged_prefill_attention(
        q, k_pages, v_pages, block_table, query_start, context_lens, scale, causal=causal, window=window
    )


def sdpa_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, step: StepFacts, scale: float
) -> Tensor:
    """Per row: gather the row's K/V pages, then one SDPA call (flash) with bottom-right causal masking
    -> [N, nH, D], ungated (the baseline of `fast_gated_prefill_attention`, see the module docstring).

    Row bounds and lengths come from the step's host copies (no device read-back)."""
    from torch.nn.attention.bias import causal_lower_right

    page_size, n_kv = k_pages.shape[1], k_pages.shape[2]
    group = q.shape[1] // n_kv
    block_table = step.block_table
    out = torch.empty_like(q)
    starts, lengths = step.query_bounds(), step.context_lengths()
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
