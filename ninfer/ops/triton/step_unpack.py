"""Triton unpack of a step's packed int64 vector into the `StepBatch` device tensors: one launch.

`StepBuilder.unpack` (``ninfer.targets.qwen3_6.impl.runtime.step``) runs inside every captured decode graph,
where its torch form is four small kernels in a row (``query_start.int()``, ``context_lens.int()``, the
block-table row gather ``index_select`` and ``fresh.bool()``), a measurable part of a short decode step with
nothing to overlap them (docs/benchmarks.md, "Why the kernels are as they are", small kernels). Here one
kernel does all four: program (r, c) copies column block c of row r's table row (the row of sequence
``sequence_index[r]``), and the programs of column block 0 also write row r's query_start, context_lens and
fresh entries (row 0 also query_start[B]). Same values as the torch expressions: int64 to int32 keeps the low
32 bits as ``.int()`` does, fresh is ``value != 0``.

With a ``feed`` (a decode: one token per row) those programs also write row r's token id, ``feed[r]`` where
the packed id is negative: a decode graph's next replay takes the tokens its last replay drew without a
device copy between the two (`graphs.DecodeGraphs`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ninfer.ops.triton import pdl, schedule

__all__ = ["unpack_step"]

_BLOCK = 1024  # table columns per program: a 4096-page table row is 4 programs


# no specialisation on the sizes: a prefill chunk of any length reuses the one compiled kernel (Triton would
# otherwise compile again, on the request path, for lengths that are 1 or divisible by 16)
@triton.jit(do_not_specialize=["num_tokens", "num_rows", "num_cols", "stride_table"])
def _unpack_step_kernel(
    values_ptr, tables_ptr, query_start_ptr, context_lens_ptr, table_ptr, fresh_ptr, num_tokens, num_rows,
    num_cols, stride_table, feed_ptr, token_ids_ptr, BLOCK: tl.constexpr, FEED: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    block = tl.program_id(1)
    # `StepFields` order: token_ids, positions, slot_mapping [N] each, query_start [B + 1], then context_lens,
    # state_in, state_out, fresh, sequence_index [B] each
    query_start_at = 3 * num_tokens
    context_lens_at = query_start_at + num_rows + 1
    fresh_at = context_lens_at + 3 * num_rows
    sequence_at = fresh_at + num_rows
    sequence = tl.load(values_ptr + sequence_at + row)  # int64: the table offset below cannot overflow
    cols = block * BLOCK + tl.arange(0, BLOCK)
    valid = cols < num_cols
    pages = tl.load(tables_ptr + sequence * stride_table + cols, mask=valid)
    tl.store(table_ptr + row.to(tl.int64) * num_cols + cols, pages, mask=valid)
    if block == 0:
        tl.store(query_start_ptr + row, tl.load(values_ptr + query_start_at + row).to(tl.int32))
        tl.store(context_lens_ptr + row, tl.load(values_ptr + context_lens_at + row).to(tl.int32))
        tl.store(fresh_ptr + row, (tl.load(values_ptr + fresh_at + row) != 0).to(tl.uint8))
        if FEED:  # a decode: row r's token is entry r
            token = tl.load(values_ptr + row)
            if token < 0:
                token = tl.load(feed_ptr + row)
            tl.store(token_ids_ptr + row, token)
        if row == 0:
            tl.store(query_start_ptr + num_rows, tl.load(values_ptr + query_start_at + num_rows).to(tl.int32))


def unpack_step(
    values: torch.Tensor,
    num_tokens: int,
    num_rows: int,
    block_tables: torch.Tensor,
    feed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(query_start int32 [B + 1], context_lens int32 [B], block_table int32 [B, max_pages], fresh bool [B],
    token_ids int64 [B] or None) of a packed step (`StepFields` layout, N = ``num_tokens``, B =
    ``num_rows``) in one launch: the same as ``query_start.int()``, ``context_lens.int()``,
    ``block_tables.index_select(0, sequence_index)``, ``fresh.bool()`` and, with ``feed`` ([B] int64, a
    decode only: N == B), ``torch.where(token_ids < 0, feed, token_ids)``. The sequence indices must be
    rows of ``block_tables`` (not checked: that would be a host sync; torch's index_select would fail a
    device assert instead)."""
    if num_tokens < 0 or num_rows < 0:
        raise ValueError(f"num_tokens and num_rows must be >= 0, got {num_tokens} and {num_rows}")
    if feed is not None and (
        num_tokens != num_rows or feed.shape != (num_rows,) or feed.dtype != torch.int64
        or feed.device != values.device or (num_rows > 1 and feed.stride(0) != 1)
    ):  # fmt: skip
        raise ValueError(
            f"feed needs a decode (num_tokens == num_rows, got {num_tokens} and {num_rows}) and must be "
            f"[{num_rows}] int64 on {values.device} with a unit stride, got {tuple(feed.shape)} {feed.dtype}"
        )
    length = 3 * num_tokens + 6 * num_rows + 1
    if values.dim() != 1 or values.dtype != torch.int64 or values.shape[0] != length:
        raise ValueError(
            f"values must be 1-D int64 of length 3 * num_tokens + 6 * num_rows + 1 = {length}, "
            f"got {tuple(values.shape)} {values.dtype}"
        )
    if values.shape[0] > 1 and values.stride(0) != 1:
        raise ValueError(f"values must have a unit stride, got {values.stride(0)}")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be 2-D int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if block_tables.shape[1] > 1 and block_tables.stride(1) != 1:
        raise ValueError(f"block_tables must have a unit last stride, got {block_tables.stride()}")
    if block_tables.device != values.device:
        raise ValueError(f"block_tables is on {block_tables.device} but values on {values.device}")
    device, max_pages = values.device, block_tables.shape[1]
    query_start = torch.empty(num_rows + 1, dtype=torch.int32, device=device)
    context_lens = torch.empty(num_rows, dtype=torch.int32, device=device)
    table = torch.empty((num_rows, max_pages), dtype=torch.int32, device=device)
    fresh = torch.empty(num_rows, dtype=torch.bool, device=device)
    token_ids = None if feed is None else torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:  # no program to write query_start[0]
        query_start.copy_(values[3 * num_tokens :])
        return query_start, context_lens, table, fresh, token_ids
    block = min(_BLOCK, triton.next_power_of_2(max(max_pages, 1)))
    if schedule.recording:
        schedule.record(
            "step_unpack._unpack_step_kernel",
            writes={"query_start": query_start, "context_lens": context_lens, "block_table": table,
                    "fresh": fresh, "token_ids": token_ids},
        )  # fmt: skip
    _unpack_step_kernel[(num_rows, max(1, triton.cdiv(max_pages, block)))](
        values, block_tables, query_start, context_lens, table, fresh.view(torch.uint8), num_tokens, num_rows,
        max_pages, block_tables.stride(0), values if feed is None else feed,
        values if token_ids is None else token_ids, BLOCK=block, FEED=feed is not None, num_warps=4,
        USE_PDL=pdl.ENABLED, **pdl.LAUNCH,
    )  # fmt: skip
    return query_start, context_lens, table, fresh, token_ids
