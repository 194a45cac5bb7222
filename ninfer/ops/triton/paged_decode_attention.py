"""Triton paged decode attention, GQA packed, optional split-KV (fast path of the reference
`ninfer.ops.attention.paged_decode_attention`: its arguments and semantics, plus the optional gate and
the launch settings below).

One query per row: q [B, nH, D]; K/V pages [P, page_size, nKV, D]; row r's context is the first
context_lens[r] token slots of its pages block_table[r]. One program handles one (row, kv head, split)
and all `group = nH / nKV` query heads of that kv head as the rows of one [group, D] tile, so every K/V
block is read once per kv head and the scores are a matrix product (tensor cores at group 6 or 8,
padded to 16 rows). The softmax is online, in fp32, over the row's own tokens only: the loop bound is
read from context_lens on the device, so the cost follows the live length, and there is no host sync
(CUDA-graph capturable).

Split-KV (`num_splits` > 1) cuts each row's context into equal ranges handled by separate programs
(decode at small B has too few (row, kv head) pairs to fill the GPU); a second kernel merges their
partial outputs with their log-sum-exps, each merge program over `merge_block_d` columns of one head
(64 of 256: a [splits, 64] fp32 tile, where the whole head's took 255 registers at 64 splits).

Under programmatic dependent launch, with `settled=True`, each split program loads its first
`preload_blocks` key blocks' K and V before its wait (`pdl`): the row's length and table are step inputs
and every position but the row's newest was written by an earlier step. The newest position is the one
the attention prologue, the kernel just before this one, is writing; after the wait the program that
holds it in a preloaded block loads that row again (from L2) and puts it in place. So the first key
block's HBM latency overlaps the kernels before, instead of following the row length and table loads
after the wait. The merge issues its log-sum-exp, partial and gate loads at once (every split stores
its partial, zeros when its range is empty, so the partials' loads need not wait for the
log-sum-exps). Both together measured faster in the 35B-A3B decode graph at one and eight rows
(docs/benchmarks.md, "Why the kernels are as they are", decode attention).

With ``gate_qkv`` the output gate of Qwen3.6's gated attention is applied where the output is written
(the single-split kernel or the merge): o, rounded to q's dtype, times sigmoid(gate) in fp32, the gate read
in place from the q projection's interleaved [query | gate] columns, exactly as
`attention_prologue.sigmoid_gate` computes it (the same bits) without that kernel's launch and its
dependent wait.

A row with context length 0 (padding) gets a zero output (the reference gives NaN there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["paged_decode_attention", "default_num_splits"]


@triton.jit
def _load_gate(gate_ptr, row, heads, offs_d, mask, gate_stride_b, HEAD_DIM: tl.constexpr):
    """Head h's output gate: columns h*2D + D .. h*2D + 2D - 1 of the interleaved q projection."""
    return tl.load(gate_ptr + row * gate_stride_b + heads * 2 * HEAD_DIM + HEAD_DIM + offs_d, mask=mask)


@triton.jit
def _store_output(
    out_ptr, row, heads, offs_d, mask, out_stride_b, out_stride_h, o, gate, GATED: tl.constexpr
):  # fmt: skip
    """Store o [rows of heads, D] (fp32) in out's dtype; GATED: times sigmoid(gate) first, as `sigmoid_gate`
    does it (o rounded to out's dtype, then fp32 math, rounded again)."""
    y = o.to(out_ptr.dtype.element_ty)
    if GATED:
        y = (y.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_stride_b + heads * out_stride_h + offs_d, y, mask=mask)


@triton.jit
def _kv_block(
    k_pages_ptr, v_pages_ptr, table_row, block_start, end, kv_head, offs_n, offs_d, mask_d,
    k_stride_page, k_stride_slot, k_stride_head, v_stride_page, v_stride_slot, v_stride_head,
    PAGE_SIZE: tl.constexpr,
):  # fmt: skip
    """The K and V tiles [BLOCK_N, BLOCK_D] of positions block_start.. (masked at end) -> (positions, live
    mask, k, v)."""
    positions = block_start + offs_n
    mask_n = positions < end
    pages = tl.load(table_row + positions // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    in_page = positions % PAGE_SIZE
    mask_kv = mask_n[:, None] & mask_d[None, :]
    k_offs = pages * k_stride_page + in_page * k_stride_slot + kv_head * k_stride_head
    k = tl.load(k_pages_ptr + k_offs[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
    v_offs = pages * v_stride_page + in_page * v_stride_slot + kv_head * v_stride_head
    v = tl.load(v_pages_ptr + v_offs[:, None] + offs_d[None, :], mask=mask_kv, other=0.0)
    return positions, mask_n, k, v


@triton.jit
def _attend(q, k, v, mask_n, m_i, l_i, acc, scale, DOT_PRECISION: tl.constexpr):
    """One key block of the online softmax: (m_i, l_i, acc) updated. The block holds a live position."""
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [BLOCK_G, BLOCK_N]
    scores = tl.where(mask_n[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the block holds a live position
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_pages_ptr,
    v_pages_ptr,
    block_table_ptr,
    context_lens_ptr,
    out_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    gate_ptr,
    scale,
    q_stride_b,
    q_stride_h,
    k_stride_page,
    k_stride_slot,
    k_stride_head,
    v_stride_page,
    v_stride_slot,
    v_stride_head,
    block_table_stride,
    out_stride_b,
    out_stride_h,
    gate_stride_b,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    GATED: tl.constexpr,
    SETTLED: tl.constexpr,
    PRELOAD_BLOCKS: tl.constexpr,
    STALE_NEWEST: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    if not SETTLED:  # nothing is read before the wait (PRELOAD_BLOCKS is 0 then)
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # ---- before the wait (SETTLED): the row's length and table (the step's inputs) and the first
    # PRELOAD_BLOCKS key blocks' K and V (written by earlier steps, except the row's newest position,
    # which the prologue just before this kernel is writing: patched after the wait)
    context_len = tl.load(context_lens_ptr + row)
    # equal ranges per split, rounded up to whole key blocks; trailing splits may be empty
    split_len = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(context_len, start + split_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    table_row = block_table_ptr + row.to(tl.int64) * block_table_stride
    preloaded = ()  # (positions, mask_n, k, v) of block i at 4 * i
    for i in tl.static_range(PRELOAD_BLOCKS):
        preloaded = preloaded + _kv_block(
            k_pages_ptr, v_pages_ptr, table_row, start + i * BLOCK_N, end, kv_head, offs_n, offs_d, mask_d,
            k_stride_page, k_stride_slot, k_stride_head, v_stride_page, v_stride_slot, v_stride_head,
            PAGE_SIZE,
        )  # fmt: skip
    if PRELOAD_BLOCKS > 0:
        newest = context_len - 1
        has_newest = (newest >= start) & (newest < tl.minimum(end, start + PRELOAD_BLOCKS * BLOCK_N))
        newest_page = tl.load(table_row + newest // PAGE_SIZE, mask=has_newest, other=0).to(tl.int64)
        newest_slot = newest % PAGE_SIZE

    if SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)

    q = tl.load(
        q_ptr + row * q_stride_b + heads[:, None] * q_stride_h + offs_d[None, :],
        mask=mask_g[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    if PRELOAD_BLOCKS > 0:
        # the newest position's K and V as the prologue wrote them (this program's own preloaded copy of
        # that slot may predate the write); .cg: from L2, never the line the early load left in L1
        mask_new = mask_d & has_newest
        new_k = tl.load(
            k_pages_ptr + newest_page * k_stride_page + newest_slot * k_stride_slot + kv_head * k_stride_head
            + offs_d, mask=mask_new, other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        new_v = tl.load(
            v_pages_ptr + newest_page * v_stride_page + newest_slot * v_stride_slot + kv_head * v_stride_head
            + offs_d, mask=mask_new, other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        for i in tl.static_range(PRELOAD_BLOCKS):
            positions = preloaded[4 * i]
            mask_n = preloaded[4 * i + 1]
            k = preloaded[4 * i + 2]
            v = preloaded[4 * i + 3]
            if start + i * BLOCK_N < end:
                is_new = (positions == newest)[:, None]
                if STALE_NEWEST:  # tests: the early copy of the newest row as a stale read leaves it
                    k = tl.where(is_new, float("nan"), k)
                    v = tl.where(is_new, float("nan"), v)
                k = tl.where(is_new, new_k[None, :], k)
                v = tl.where(is_new, new_v[None, :], v)
                m_i, l_i, acc = _attend(q, k, v, mask_n, m_i, l_i, acc, scale, DOT_PRECISION)
    for block_start in range(start + PRELOAD_BLOCKS * BLOCK_N, end, BLOCK_N):
        positions, mask_n, k, v = _kv_block(
            k_pages_ptr, v_pages_ptr, table_row, block_start, end, kv_head, offs_n, offs_d, mask_d,
            k_stride_page, k_stride_slot, k_stride_head, v_stride_page, v_stride_slot, v_stride_head,
            PAGE_SIZE,
        )  # fmt: skip
        m_i, l_i, acc = _attend(q, k, v, mask_n, m_i, l_i, acc, scale, DOT_PRECISION)

    live = l_i > 0.0  # false only for an empty range (padding row or an unused trailing split)
    normed = acc / tl.where(live, l_i, 1.0)[:, None]
    mask_out = mask_g[:, None] & mask_d[None, :]
    if NUM_SPLITS == 1:
        gate = 0.0
        if GATED:
            gate = _load_gate(
                gate_ptr, row, heads[:, None], offs_d[None, :], mask_out, gate_stride_b, HEAD_DIM
            )
        _store_output(
            out_ptr, row, heads[:, None], offs_d[None, :], mask_out, out_stride_b, out_stride_h, normed, gate,
            GATED,
        )  # fmt: skip
    else:
        partial_row = (row.to(tl.int64) * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + offs_d[None, :], normed, mask=mask_out)
        lse = tl.where(live, m_i + tl.log(tl.where(live, l_i, 1.0)), float("-inf"))
        tl.store(partial_lse_ptr + partial_row, lse, mask=mask_g)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    gate_ptr,
    out_stride_b,
    out_stride_h,
    gate_stride_b,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GATED: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter_launching_next(LAUNCH_NEXT_EARLY, USE_PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    mask_d = offs_d < HEAD_DIM
    base = (row.to(tl.int64) * NUM_HEADS + head) * NUM_SPLITS
    # three independent loads, all issued at once: every split wrote its partial (zeros when its range
    # was empty), so the partials need not wait for the log-sum-exps to say which splits are live
    gate = 0.0
    if GATED:
        gate = _load_gate(gate_ptr, row, head, offs_d, mask_d, gate_stride_b, HEAD_DIM)
    lse = tl.load(partial_lse_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
    partial = tl.load(
        partial_out_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=mask_s[:, None] & mask_d[None, :],
        other=0.0,
    )
    live = lse > float("-inf")
    lse_max = tl.max(tl.where(live, lse, -3.0e38), axis=0)  # finite even when no split is live
    weights = tl.where(live, tl.exp(lse - lse_max), 0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(partial * weights[:, None], axis=0) / tl.where(total > 0.0, total, 1.0)
    _store_output(out_ptr, row, head, offs_d, mask_d, out_stride_b, out_stride_h, merged, gate, GATED)


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Static split count (no host sync): about one wave of programs over the GPU's SMs, but at least 16
    splits, at most one per 32 positions of the table's capacity and 128 in all. 1 on CPU.

    Tuned on the H200, alone and inside the decode graph (docs/benchmarks.md, "Why the kernels are as they
    are", decode attention): at B = 1 many splits beat the former 8 by far; at B = 8 35B-A3B is faster with
    16 splits than with two waves' 32, and 27B slower with one wave's 8 than with 16 (hence the floor);
    where this rule and the two-wave one differ at other B they timed within noise of each other. The cap
    was 64: 35B-A3B at B = 1 (2 kv heads) takes 128, so that at 2,049-4,096 positions every split is one
    key block, loaded before the PDL wait (measured faster).
    """
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = max(16, triton.cdiv(sm_count, max(1, batch * num_kv_heads)))
    cap = max(1, triton.cdiv(max_context, 32))
    return max(1, min(triton.next_power_of_2(wanted), triton.next_power_of_2(cap), 128))


def _record(
    k_pages: torch.Tensor, v_pages: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
    out: torch.Tensor, partial_out: torch.Tensor, partial_lse: torch.Tensor, num_splits: int, *,
    settled: bool, preload_blocks: int, launch_next_early: bool,
) -> None:  # fmt: skip
    """The split and merge launches for `schedule`: with ``settled`` the lengths and the table are read
    before the wait, and with preloaded blocks every K/V position but each query's newest."""
    early: dict[str, torch.Tensor | schedule.Part] = {}
    if settled:
        early = {"context_lens": context_lens, "block_table": block_table}
        if preload_blocks > 0:
            but_newest = schedule.KvPositions.ALL_BUT_NEWEST
            early["k_pages"] = schedule.Part(k_pages, but_newest)
            early["v_pages"] = schedule.Part(v_pages, but_newest)
    split_writes = {"partial_out": partial_out, "partial_lse": partial_lse}
    if num_splits == 1:
        split_writes = {"out": out}
    schedule.record(
        "paged_decode_attention._paged_decode_kernel", launch_next_early=launch_next_early, early_reads=early,
        writes=split_writes,
    )
    if num_splits > 1:
        schedule.record(
            "paged_decode_attention._merge_splits_kernel", launch_next_early=launch_next_early,
            writes={"out": out},
        )


def paged_decode_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
    launch_next_early: bool = False,
    gate_qkv: torch.Tensor | None = None,
    settled: bool = False,
    preload_blocks: int = 1,
    merge_block_d: int = 64,
    stale_newest_for_tests: bool = False,
) -> torch.Tensor:
    """Decode attention over paged K/V -> [B, nH, D] in q's dtype (fp32 softmax and accumulation).

    q [B, nH, D]; k_pages, v_pages [P, page_size, nKV, D] with a contiguous last dim; block_table
    [B, maxp] int32; context_lens [B] int32 (row r's query is the last of its context_lens[r] positions).
    `out` may supply the [B, nH, D] output buffer; `num_splits` defaults to `default_num_splits`.
    `launch_next_early`: see `pdl` (with splits, the merge launch follows the split launch early too).
    `gate_qkv` [B, >= nH*2D] (row stride free, last dim contiguous): the output is gated, o * sigmoid(gate)
    with head h's gate in columns h*2D + D .. h*2D + 2D - 1 (`attention_prologue.sigmoid_gate`'s result,
    bit for bit, as [B, nH, D]: view it as [B, nH*D]).
    `settled=True`: under `pdl`, context_lens, block_table and every K/V position but each row's newest
    (context_lens[r] - 1) are complete before this kernel can launch (the step's inputs, and K/V written
    by earlier steps; only the kernel just before may write the newest positions), so the lengths, the
    table and the first `preload_blocks` key blocks load before the wait; otherwise nothing does.
    `merge_block_d`: head-dim columns per merge program. `stale_newest_for_tests`: each preloaded copy of a
    row's newest position is NaN before the patch, as a read that raced the prologue would leave it (the
    output must not change; a test hook, the interpreter having no race to lose).
    """
    if preload_blocks < 0 or merge_block_d < 1:
        raise ValueError(
            f"need preload_blocks >= 0 and merge_block_d >= 1, got {preload_blocks} and {merge_block_d}"
        )
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, kv_dim = k_pages.shape
    if v_pages.shape != k_pages.shape or kv_dim != head_dim or num_heads % num_kv_heads != 0:
        raise ValueError(f"q {tuple(q.shape)} vs pages k {tuple(k_pages.shape)} v {tuple(v_pages.shape)}")
    if block_table.shape[0] != batch or context_lens.shape != (batch,):
        raise ValueError(f"block_table {tuple(block_table.shape)} / context_lens {tuple(context_lens.shape)}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_pages.stride(-1) != 1 or v_pages.stride(-1) != 1:
        raise ValueError("K/V pages need a contiguous head dim")
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, nH, D] {q.dtype} with a contiguous last dim")
    if gate_qkv is not None and (
        gate_qkv.dim() != 2
        or gate_qkv.shape[0] != batch
        or gate_qkv.shape[1] < 2 * num_heads * head_dim
        or gate_qkv.stride(1) != 1
    ):
        raise ValueError(
            f"gate_qkv must be [{batch}, >= {2 * num_heads * head_dim}] with a contiguous last dim, "
            f"got {tuple(gate_qkv.shape)}"
        )
    if batch == 0:
        return out

    gated = gate_qkv is not None
    gate, gate_stride = (gate_qkv, gate_qkv.stride(0)) if gate_qkv is not None else (out, 0)  # unread then
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(batch, num_kv_heads, block_table.shape[1] * page_size, q.device)
    block_d = triton.next_power_of_2(head_dim)
    block_g = max(16, triton.next_power_of_2(group))  # tl.dot needs at least 16 rows
    dot_precision = "ieee" if q.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding of scores
    if num_splits > 1:
        partial_out = torch.empty(
            batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device
        )
        partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        partial_out = partial_lse = out  # not touched by the single-split kernel
    if schedule.recording:
        _record(
            k_pages, v_pages, block_table, context_lens, out, partial_out, partial_lse, num_splits,
            settled=settled, preload_blocks=preload_blocks, launch_next_early=launch_next_early,
        )  # fmt: skip
    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_pages, v_pages, block_table, context_lens, out, partial_out, partial_lse, gate,
        scale,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        block_table.stride(0),
        out.stride(0), out.stride(1), gate_stride,
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=num_splits,
        BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n, DOT_PRECISION=dot_precision, GATED=gated,
        SETTLED=settled, PRELOAD_BLOCKS=preload_blocks if settled else 0,
        STALE_NEWEST=stale_newest_for_tests, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=num_warps,
        num_stages=num_stages,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    if num_splits > 1:
        merge_block_d = min(block_d, triton.next_power_of_2(merge_block_d))
        _merge_splits_kernel[(batch, num_heads, triton.cdiv(head_dim, merge_block_d))](
            partial_out, partial_lse, out, gate,
            out.stride(0), out.stride(1), gate_stride,
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=merge_block_d, GATED=gated,
            LAUNCH_NEXT_EARLY=launch_next_early, num_warps=4,
            USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
        )  # fmt: skip
    return out
