"""Triton varlen paged causal attention for prefill, GQA read in place (fast path of the reference
`ninfer.ops.attention.paged_attention`: its arguments and semantics, plus the optional gate).

Rows of any length: q [N, nH, D] holds row r's queries at tokens query_start[r] .. query_start[r+1] - 1,
the last tokens of a context of context_lens[r] positions whose K/V (the queries' own included) are in
the row's pages block_table[r] of [P, page_size, nKV, D]. Query i of the row sees positions 0 .. its own;
or, for a DFlash drafter's block (`ninfer.ops.attention.paged_block_attention`), the whole context
(``causal=False``) and/or only a sliding ``window`` of it.

One program handles `BLOCK_M` consecutive queries of one row and one query head (a flash-attention
forward: online softmax in fp32 over `BLOCK_N`-key blocks, scores and the output as tensor-core
products). The key blocks every query of the tile sees run without a mask; only the blocks across the
tile's causal diagonal are masked. The six (27B) or eight (35B-A3B) query heads of one kv head are
neighbouring programs, so a K/V block is read from HBM about once and from L2 by the others, instead of
being repeated per head in memory as the SDPA path does.

Everything the grid depends on is the step's shape (N tokens, B rows): the grid is
``(nH, N // BLOCK_M + B)``, the row bounds and lengths are read on the device (each program finds its row
by a binary search over query_start), so there is no host sync and the launch is CUDA-graph capturable,
padded capacity included (tokens from query_start[B] on are not written, or zeroed on request).

With ``gate_qkv`` the output is gated where it is written: o rounded to q's dtype, times sigmoid(gate) in
fp32, the gate read in place from the q projection's interleaved [query | gate] columns, exactly as
`attention_prologue.sigmoid_gate` computes it; the result is then [N, nH*D].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["paged_prefill_attention", "PrefillTiles"]

_MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis


@triton.jit
def _kv_tiles(
    k_ptr, v_ptr, table_row, start_n, context_len, kv_head, offs_n, offs_d, mask_d,
    kv_stride_page, kv_stride_slot, kv_stride_head,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """K^T [BLOCK_D, BLOCK_N] and V [BLOCK_N, BLOCK_D] of positions start_n .. start_n + BLOCK_N - 1."""
    positions = start_n + offs_n
    if PAGE_SIZE % BLOCK_N == 0:  # the block lies in one page: one table read, contiguous slots
        page = tl.load(table_row + start_n // PAGE_SIZE).to(tl.int64)
        offs = page * kv_stride_page + (start_n % PAGE_SIZE + offs_n) * kv_stride_slot
    else:
        pages = tl.load(table_row + positions // PAGE_SIZE, mask=positions < context_len, other=0)
        offs = pages.to(tl.int64) * kv_stride_page + (positions % PAGE_SIZE) * kv_stride_slot
    offs += kv_head * kv_stride_head
    if MASKED:  # noqa: SIM108 - a compile-time branch
        mask = (positions < context_len)[:, None] & mask_d[None, :]
    else:
        mask = mask_d[None, :]
    k = tl.load(k_ptr + offs[None, :] + offs_d[:, None], mask=tl.trans(mask), other=0.0)
    v = tl.load(v_ptr + offs[:, None] + offs_d[None, :], mask=mask, other=0.0)
    return k, v


@triton.jit
def _attend(
    acc, m_i, l_i, q, k_ptr, v_ptr, table_row, lo, hi, context_len, q_positions, kv_head, offs_n, offs_d,
    mask_d, qk_scale, kv_stride_page, kv_stride_slot, kv_stride_head, window,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    """Fold key blocks lo .. hi (multiples of BLOCK_N from lo) into the online softmax (log2 domain).
    ``MASKED``: the blocks' keys are checked against the context's end, and (``CAUSAL``) each query's
    position and (``WINDOWED``) its window."""
    for start_n in range(lo, hi, BLOCK_N):
        k, v = _kv_tiles(
            k_ptr, v_ptr, table_row, start_n, context_len, kv_head, offs_n, offs_d, mask_d,
            kv_stride_page, kv_stride_slot, kv_stride_head, PAGE_SIZE, BLOCK_N, MASKED,
        )  # fmt: skip
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            positions = start_n + offs_n
            visible = (positions < context_len)[None, :]
            if CAUSAL:
                visible &= positions[None, :] <= q_positions[:, None]
            if WINDOWED:
                visible &= q_positions[:, None] - positions[None, :] < window
                if not CAUSAL:
                    visible &= positions[None, :] - q_positions[:, None] < window
            s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
        if WINDOWED:  # a query's keys so far may all lie before its window: its max is still -inf
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_use)
        p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, gate_ptr, block_table_ptr, query_start_ptr, context_lens_ptr,
    qk_scale, num_rows, num_tokens,
    q_stride_n, q_stride_h, out_stride_n, out_stride_h, gate_stride_n,
    kv_stride_page, kv_stride_slot, kv_stride_head, table_stride, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GATED: tl.constexpr, ZERO_PADDING: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    head = tl.program_id(0)
    # the last query blocks first: under the causal mask they see the most keys, so the short ones fill
    # the tail of the last wave instead of the long ones running alone
    block = tl.num_programs(1) - 1 - tl.program_id(1)
    # row r's query blocks are numbered from query_start[r] // BLOCK_M + r on (at most N // BLOCK_M + B)
    lo = 0
    hi = num_rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_ptr + mid) // BLOCK_M + mid <= block:
            lo = mid
        else:
            hi = mid
    row = lo
    row_start = tl.load(query_start_ptr + row)
    row_end = tl.load(query_start_ptr + row + 1)
    m_start = row_start + (block - row_start // BLOCK_M - row) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tokens = (m_start + offs_m).to(tl.int64)
    out_offs = tokens[:, None] * out_stride_n + head * out_stride_h + offs_d[None, :]
    if m_start < row_end:
        context_len = tl.load(context_lens_ptr + row)
        first_position = context_len - (row_end - row_start) + (m_start - row_start)
        offs_n = tl.arange(0, BLOCK_N)
        mask_m = m_start + offs_m < row_end
        q_positions = first_position + offs_m
        q = tl.load(
            q_ptr + tokens[:, None] * q_stride_n + head * q_stride_h + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :], other=0.0,
        )  # fmt: skip
        kv_head = head // GROUP
        table_row = block_table_ptr + row.to(tl.int64) * table_stride
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        if WINDOWED:
            # every block from the first query's window start on is masked: a window's edge and the
            # diagonal both cross the tile (each query sees its own position, so no live row's running
            # max stays -inf; dead rows past the row's end are never stored)
            kv_start = tl.maximum(first_position - window + 1, 0) // BLOCK_N * BLOCK_N
            unmasked_end = kv_start
        elif CAUSAL:
            # keys 0 .. first_position are visible to every query of the tile; the blocks after them, up
            # to the tile's last live position, cross the diagonal. The first block always holds position
            # 0, which every query sees, so no row of the running max stays -inf.
            kv_start = 0
            unmasked_end = (first_position + 1) // BLOCK_N * BLOCK_N
        else:  # every query sees the whole context: only its last block is cut by the end
            kv_start = 0
            unmasked_end = context_len // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(context_len, first_position + BLOCK_M) if CAUSAL else context_len
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, k_ptr, v_ptr, table_row, kv_start, unmasked_end, context_len, q_positions,
            kv_head, offs_n, offs_d, mask_d, qk_scale, kv_stride_page, kv_stride_slot, kv_stride_head, window,
            PAGE_SIZE, BLOCK_N, False, DOT_PRECISION, CAUSAL, WINDOWED,
        )  # fmt: skip
        acc, m_i, l_i = _attend(
            acc, m_i, l_i, q, k_ptr, v_ptr, table_row, unmasked_end, kv_end, context_len, q_positions,
            kv_head, offs_n, offs_d, mask_d, qk_scale, kv_stride_page, kv_stride_slot, kv_stride_head, window,
            PAGE_SIZE, BLOCK_N, True, DOT_PRECISION, CAUSAL, WINDOWED,
        )  # fmt: skip
        o = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        mask = mask_m[:, None] & mask_d[None, :]
        if GATED:
            gate = tl.load(
                gate_ptr + tokens[:, None] * gate_stride_n + head * 2 * HEAD_DIM + HEAD_DIM + offs_d[None, :],
                mask=mask, other=0.0,
            )  # fmt: skip
            o = (o.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_offs, o, mask=mask)
    # the last row's blocks reach the end of the tokens: the padding after it reads zeros
    if ZERO_PADDING:  # noqa: SIM102 - a compile-time branch around a run-time one
        if row == num_rows - 1:
            padding = (m_start + offs_m >= row_end) & (m_start + offs_m < num_tokens)
            zeros = tl.zeros([BLOCK_M, BLOCK_D], out_ptr.dtype.element_ty)
            tl.store(out_ptr + out_offs, zeros, mask=padding[:, None] & mask_d[None, :])


@dataclass(frozen=True)
class PrefillTiles:
    """Launch shape of the prefill kernel: queries and keys per block, warps, pipeline stages.

    The default, 64 queries x 32 keys over 4 warps in 3 stages, was the fastest or within 2 % of it at
    every 27B and 35B-A3B shape of the H200 sweep (head dim 256; docs/benchmarks.md, run 27)."""

    block_m: int = 64
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name, value in (("block_m", self.block_m), ("block_n", self.block_n)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")


def paged_prefill_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    gate_qkv: torch.Tensor | None = None,
    zero_padding: bool = False,
    out: torch.Tensor | None = None,
    tiles: PrefillTiles | None = None,
    causal: bool = True,
    window: int | None = None,
) -> torch.Tensor:
    """Varlen paged causal attention -> [N, nH, D] in q's dtype, or gated [N, nH*D] with ``gate_qkv``.

    q [N, nH, D] (last dim contiguous); k_pages, v_pages [P, page_size, nKV, D] (last dim contiguous);
    block_table [B, maxp] int32; query_start [B+1] int32 from 0 (never read back); context_lens [B]
    int32, with row r's query count at most its context length. Tokens from query_start[B] on are not
    written, or written as zeros with ``zero_padding`` (a prefill graph's padding, `StepFacts.padded`).
    ``gate_qkv`` [N, >= nH*2D] (row stride free, last dim contiguous): head h's gate in columns
    h*2D + D .. h*2D + 2D - 1. ``out`` may supply the output buffer ([N, nH, D], or [N, nH*D] gated; last
    dim contiguous). Without ``causal`` every query sees its row's whole context (a DFlash drafter's
    block, `ninfer.ops.attention.paged_block_attention`); ``window``: only keys less than ``window``
    positions before it (and, without ``causal``, after it).
    """
    n, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_pages.shape
    if v_pages.stride() != k_pages.stride() or v_pages.shape != k_pages.shape or kv_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} vs pages k {tuple(k_pages.shape)} v {tuple(v_pages.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    rows = context_lens.shape[0]
    if query_start.shape != (rows + 1,) or block_table.shape[0] != rows:
        raise ValueError(
            f"query_start {tuple(query_start.shape)} / block_table {tuple(block_table.shape)} do not fit "
            f"{rows} rows"
        )
    if k_pages.stride(-1) != 1:
        raise ValueError("K/V pages need a contiguous head dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    gated = gate_qkv is not None
    shape = (n, num_heads * head_dim) if gated else (n, num_heads, head_dim)
    if gate_qkv is not None and (
        gate_qkv.dim() != 2 or gate_qkv.shape[0] != n or gate_qkv.shape[1] < 2 * num_heads * head_dim
        or gate_qkv.stride(1) != 1
    ):  # fmt: skip
        raise ValueError(
            f"gate_qkv must be [{n}, >= {2 * num_heads * head_dim}] with a contiguous last dim, "
            f"got {tuple(gate_qkv.shape)}"
        )
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif out.shape != shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {list(shape)} {q.dtype} with a contiguous last dim")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if n == 0 or rows == 0:
        return out
    tiles = tiles or PrefillTiles()
    out_heads = out.view(n, num_heads, head_dim)
    gate, gate_stride = (gate_qkv, gate_qkv.stride(0)) if gate_qkv is not None else (q, 0)  # unread then
    if schedule.recording:
        schedule.record("paged_prefill_attention._paged_prefill_kernel", writes={"out": out})
    grid = (num_heads, n // tiles.block_m + rows)
    if grid[1] > _MAX_GRID_Y:
        raise ValueError(f"{n} tokens in {rows} rows need {grid[1]} query blocks, more than {_MAX_GRID_Y}")
    _paged_prefill_kernel[grid](
        q, k_pages, v_pages, out_heads, gate, block_table, query_start, context_lens,
        scale * 1.4426950408889634, rows, n,
        q.stride(0), q.stride(1), out_heads.stride(0), out_heads.stride(1), gate_stride,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2), block_table.stride(0), window or 0,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, GATED=gated,
        ZERO_PADDING=zero_padding,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # fp32: no TF32 scores
        USE_PDL=pdl.ENABLED, CAUSAL=causal, WINDOWED=window is not None,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **pdl.LAUNCH,
    )  # fmt: skip
    return out
