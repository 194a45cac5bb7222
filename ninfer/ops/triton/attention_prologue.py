"""Triton prologue / epilogue of Qwen3.6 gated attention (the fast table's `attention_prologue`; the
gate alone, `sigmoid_gate`, is the gated attention kernels' bit-exact reference in tests and tools).

Between the attention layer's stacked qkv GEMM and its o_proj GEMM the reference runs about a dozen
small launches (q/k RMSNorm, partial RoPE with its slices and cats, two K/V `index_copy_`s, the gate's
reshape copy, casts, the sigmoid multiply). At decode sizes each is pure launch latency, so two kernels
replace them:

- `qk_norm_rope_kv_write`: from the qkv projection output, q = rope(rms_norm(q, q_norm)) into a
  contiguous [N, nH, D] buffer, and k = rope(rms_norm(k, k_norm)) and v written straight into their paged
  KV slots. The reference table's `attention_prologue` in one launch.
- `sigmoid_gate`: o * sigmoid(gate) with the gate read in place from qkv's interleaved per-head
  [query | gate] columns: `gated_attention_output(o, split_q_gate(...)[1])` without the gate copy.

Rounding follows the reference step by step: the norm is fp32 math rounded to the model dtype (as
`rms_norm` returns), RoPE reads that rounded value, computes in fp32 and rounds to the model dtype again
(`apply_partial_rope`), and K/V are then cast to the page dtype (`kv_write`). Rotate-half RoPE pairs dim
i with dim i +- rotary_dim/2; rather than shuffling registers, each program re-reads the partner
elements (a second, cache-resident load of the same row) and normalises them with the same
1/rms, which gives exactly the partner's rounded normed value.

One program owns one (token, head) row of D elements: heads 0..nH-1 are query heads, nH..nH+nKV-1 are
KV heads (which also copy their v row). Grid (N, nH + nKV) from static shapes, no host reads of device
values: CUDA-graph capturable. Slots < 0 (padding) are skipped: no K/V write (q is still computed).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["qk_norm_rope_kv_write", "sigmoid_gate"]

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
_GATE_BLOCK = 1024  # gate elements per program: one token's 27B gate (6144) spreads over 6 programs


@triton.jit
def _norm_rope_row(
    row_ptr,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    cols,
    eps,
    MODEL_DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
):
    """rope(rms_norm(row)) of one D-element head row, each step rounded to the model dtype (fp32 out)."""
    mask = cols < HEAD_DIM
    x = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
    scale = 1.0 + tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = ((x * inv_rms) * scale).to(MODEL_DTYPE).to(tl.float32)

    # rotate-half partner: dim i < R/2 pairs with i + R/2 (and enters negated), i in [R/2, R) with i - R/2
    half = ROTARY_DIM // 2  # constexpr arithmetic
    is_rotary = cols < ROTARY_DIM
    partner = tl.where(cols < half, cols + half, cols - half)
    partner_x = tl.load(row_ptr + partner, mask=is_rotary, other=0.0).to(tl.float32)
    partner_scale = 1.0 + tl.load(weight_ptr + partner, mask=is_rotary, other=0.0).to(tl.float32)
    partner_normed = ((partner_x * inv_rms) * partner_scale).to(MODEL_DTYPE).to(tl.float32)
    rotated_half = tl.where(cols < half, -partner_normed, partner_normed)
    cos = tl.load(cos_ptr + cols, mask=is_rotary, other=1.0)
    sin = tl.load(sin_ptr + cols, mask=is_rotary, other=0.0)
    roped = normed * cos + rotated_half * sin
    return tl.where(is_rotary, roped, normed).to(MODEL_DTYPE).to(tl.float32)


@triton.jit
def _qk_norm_rope_kv_write_kernel(
    qkv_ptr,
    q_norm_ptr,
    k_norm_ptr,
    cos_ptr,
    sin_ptr,
    k_pages_ptr,
    v_pages_ptr,
    slot_ptr,
    q_out_ptr,
    qkv_stride_row,
    cos_stride_row,
    sin_stride_row,
    k_stride_page,
    k_stride_offset,
    k_stride_head,
    v_stride_page,
    v_stride_offset,
    v_stride_head,
    page_size,
    eps,
    MODEL_DTYPE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SETTLED: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    if not SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # SETTLED: the token's KV slot (a step input) is read before the wait, so that the K/V heads' loads of
    # qkv after it do not wait behind it
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if SETTLED:
        pdl.enter_after(LAUNCH_NEXT_EARLY, USE_PDL)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < HEAD_DIM
    qkv_row = qkv_ptr + token * qkv_stride_row
    cos_row = cos_ptr + token * cos_stride_row
    sin_row = sin_ptr + token * sin_stride_row
    if head < NUM_HEADS:
        # query half of this head's interleaved [query(D) | gate(D)] columns
        q = _norm_rope_row(
            qkv_row + head * 2 * HEAD_DIM, q_norm_ptr, cos_row, sin_row, cols, eps,
            MODEL_DTYPE, HEAD_DIM, ROTARY_DIM,
        )  # fmt: skip
        q_out = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(q_out + cols, q.to(MODEL_DTYPE), mask=mask)
    else:
        kv_head = head - NUM_HEADS
        k_src = qkv_row + NUM_HEADS * 2 * HEAD_DIM + kv_head * HEAD_DIM
        v_src = k_src + NUM_KV_HEADS * HEAD_DIM
        if slot >= 0:  # a negative slot is a padding token: nothing to cache
            page = slot // page_size
            offset = slot % page_size
            k = _norm_rope_row(
                k_src, k_norm_ptr, cos_row, sin_row, cols, eps, MODEL_DTYPE, HEAD_DIM, ROTARY_DIM
            )
            k_dst = k_pages_ptr + page * k_stride_page + offset * k_stride_offset + kv_head * k_stride_head
            # model dtype first (done above), then the page dtype: kv_write's k.to(k_pages.dtype)
            tl.store(k_dst + cols, k.to(k_pages_ptr.dtype.element_ty), mask=mask)
            v = tl.load(v_src + cols, mask=mask, other=0.0)
            v_dst = v_pages_ptr + page * v_stride_page + offset * v_stride_offset + kv_head * v_stride_head
            tl.store(v_dst + cols, v.to(v_pages_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sigmoid_gate_kernel(
    o_ptr,
    qkv_ptr,
    out_ptr,
    o_stride_row,
    o_stride_head,
    qkv_stride_row,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    LAUNCH_NEXT_EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter_launching_next(LAUNCH_NEXT_EARLY, USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    flat = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # column of the [N, nH*D] output row
    mask = flat < NUM_HEADS * HEAD_DIM
    head = flat // HEAD_DIM
    dim = flat % HEAD_DIM
    o = tl.load(o_ptr + token * o_stride_row + head * o_stride_head + dim, mask=mask, other=0.0)
    # the gate half of head h: columns h*2D + D .. h*2D + 2D - 1 of the interleaved q projection
    gate = tl.load(
        qkv_ptr + token * qkv_stride_row + head * 2 * HEAD_DIM + HEAD_DIM + dim, mask=mask, other=0.0
    )
    y = o.to(tl.float32) * tl.sigmoid(gate.to(tl.float32))
    tl.store(out_ptr + token * NUM_HEADS * HEAD_DIM + flat, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check_qkv(qkv: torch.Tensor, width: int) -> None:
    if qkv.dim() != 2 or qkv.shape[1] != width or (qkv.stride(1) != 1 and width > 1):
        raise ValueError(
            f"qkv must be [N, {width}] with a contiguous last dim, got {tuple(qkv.shape)} "
            f"strides {qkv.stride()}"
        )


def qk_norm_rope_kv_write(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
    out: torch.Tensor | None = None,
    settled: bool = False,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """Normed, roped q [N, nH, D] from qkv; normed, roped k and raw v written into the KV pages.

    qkv [N, nH*2D + 2*nKV*D]: per-head interleaved [query | gate] columns, then k, then v (row stride
    free, last dim contiguous). q_norm, k_norm [D] zero-centred weights; cos, sin [N, rotary_dim] fp32
    (rotary_dim <= D, even; rows may be strided). k_pages, v_pages [P, page_size, nKV, D] (last dim
    contiguous); slot_mapping [N] integer flat slots (slot s -> page s // page_size, offset s % page_size;
    distinct; a negative slot writes nothing).

    Equals `ninfer.ops.attention.qkv_heads`' q = apply_partial_rope(rms_norm(q, q_norm, eps), cos, sin) (and
    the same for k) then `kv_write(k_pages, v_pages, k, v, slot_mapping)`. q is returned contiguous in qkv's
    dtype; `out` may supply it. The gate columns are not touched (read them as a view of qkv). `settled=True`:
    slot_mapping is complete before this kernel can launch (a step input; `pdl`), so it loads before the
    programmatic-launch wait. `launch_next_early`: see `pdl`.
    """
    n = qkv.shape[0]
    d = head_dim
    if qkv.dtype not in _TL_DTYPES:
        raise ValueError(f"unsupported qkv dtype {qkv.dtype}")
    _check_qkv(qkv, num_heads * 2 * d + 2 * num_kv_heads * d)
    rotary_dim = cos.shape[-1]
    if cos.shape != (n, rotary_dim) or sin.shape != cos.shape or rotary_dim > d or rotary_dim % 2:
        raise ValueError(f"cos/sin must be [{n}, even rotary_dim <= {d}], got {tuple(cos.shape)}")
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("cos/sin need a contiguous last dim")
    if (
        q_norm.shape != (d,)
        or k_norm.shape != (d,)
        or not (q_norm.is_contiguous() and k_norm.is_contiguous())
    ):
        raise ValueError(f"q_norm/k_norm must be contiguous [{d}] vectors")
    for name, pages in (("k_pages", k_pages), ("v_pages", v_pages)):
        if pages.dim() != 4 or pages.shape[2:] != (num_kv_heads, d) or pages.stride(-1) != 1:
            raise ValueError(f"{name} must be [P, page_size, {num_kv_heads}, {d}], got {tuple(pages.shape)}")
    if v_pages.shape[1] != k_pages.shape[1]:
        raise ValueError("k_pages and v_pages must have one page size")
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must be [{n}], got {tuple(slot_mapping.shape)}")
    if out is None:
        q = torch.empty((n, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    else:
        if out.shape != (n, num_heads, d) or out.dtype != qkv.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{n}, {num_heads}, {d}] {qkv.dtype} tensor")
        q = out
    if n == 0:
        return q
    block_d = triton.next_power_of_2(d)
    if schedule.recording:
        step_tokens = schedule.KvPositions.STEP_TOKENS  # each token's own slot
        schedule.record(
            "attention_prologue._qk_norm_rope_kv_write_kernel", launch_next_early=launch_next_early,
            early_reads={"slot_mapping": slot_mapping} if settled else {},
            writes={"q": q, "k_pages": schedule.Part(k_pages, step_tokens),
                    "v_pages": schedule.Part(v_pages, step_tokens)},
        )  # fmt: skip
    _qk_norm_rope_kv_write_kernel[(n, num_heads + num_kv_heads)](
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slot_mapping, q,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        k_pages.shape[1], eps,
        MODEL_DTYPE=_TL_DTYPES[qkv.dtype],
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d, ROTARY_DIM=rotary_dim, BLOCK_D=block_d,
        SETTLED=settled, LAUNCH_NEXT_EARLY=launch_next_early, num_warps=max(1, min(4, block_d // 128)),
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return q


def sigmoid_gate(
    o: torch.Tensor,
    qkv: torch.Tensor,
    *,
    num_heads: int,
    head_dim: int,
    out: torch.Tensor | None = None,
    launch_next_early: bool = False,
) -> torch.Tensor:
    """o [N, nH, D] * sigmoid(gate) -> [N, nH*D] in o's dtype (fp32 math), gate read in place from qkv.

    qkv [N, >= nH*2D] (row stride free, last dim contiguous): head h's gate is columns h*2D + D .. h*2D +
    2D - 1 (the interleaved q projection; anything after nH*2D is ignored). o may be strided with a
    contiguous last dim. Equals `gated_attention_output(o, split_q_gate(qkv[:, :nH*2D], nH, D)[1])`;
    the result is contiguous, `out` may supply it. `launch_next_early`: see `pdl`.
    """
    n = o.shape[0]
    width = num_heads * head_dim
    if o.shape != (n, num_heads, head_dim) or (o.stride(-1) != 1 and head_dim > 1):
        raise ValueError(f"o must be [{n}, {num_heads}, {head_dim}] with a contiguous last dim")
    if qkv.dim() != 2 or qkv.shape[0] != n or qkv.shape[1] < 2 * width or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [{n}, >= {2 * width}] with a contiguous last dim, got {tuple(qkv.shape)}"
        )
    if out is None:
        y = torch.empty((n, width), dtype=o.dtype, device=o.device)
    else:
        if out.shape != (n, width) or out.dtype != o.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{n}, {width}] {o.dtype} tensor")
        y = out
    if n == 0:
        return y
    block = min(_GATE_BLOCK, triton.next_power_of_2(width))
    if schedule.recording:
        schedule.record("attention_prologue._sigmoid_gate_kernel", launch_next_early=launch_next_early,
                        writes={"out": y})  # fmt: skip
    _sigmoid_gate_kernel[(n, triton.cdiv(width, block))](
        o, qkv, y, o.stride(0), o.stride(1), qkv.stride(0),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK=block, num_warps=max(1, min(4, block // 256)),
        LAUNCH_NEXT_EARLY=launch_next_early,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return y
