"""Reference gated GQA attention of Qwen3.6 (plain PyTorch, fp32 softmax, differentiable).

Flattened-token layout: q [N, nH, D], k/v [N, nKV, D]; query head h reads kv head h // (nH / nKV).
The paged KV store is [P, page_size, nKV, D] per layer; token slot s lives at page s // page_size,
offset s % page_size. The reference paged attention gathers a row's pages and runs dense masked
softmax, so it is the oracle for any fast paged kernel.
"""

from __future__ import annotations

import torch

__all__ = [
    "split_q_gate",
    "causal_attention",
    "kv_write",
    "paged_attention",
    "gated_attention_output",
]


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
