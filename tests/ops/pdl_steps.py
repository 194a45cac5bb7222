"""Uniform steps (B rows of T tokens at the end of each row's context) with random state, for the tests
that record a forward's PDL schedule (tests/ops/test_pdl_schedule.py on CPU, tests/gpu/test_pdl_graph.py)."""

from __future__ import annotations

import torch

from ninfer.targets.qwen3_6.model import StateStore, StepBatch
from ninfer.targets.qwen3_6.variant import Variant


def uniform_step(rows: int, tokens: int, context: int, page_size: int, device: torch.device) -> StepBatch:
    """Row r's T new tokens are positions context - T .. context - 1 of its own pages; it reads GDN slot r
    and, for T > 1, writes the state after each token to slots of its own (B + r * T + t), else back to r."""
    pages = -(-context // page_size)
    gen = torch.Generator().manual_seed(rows * 10 + tokens)
    new = torch.arange(context - tokens, context)
    slots = torch.cat([r * pages * page_size + new for r in range(rows)])
    state_in = torch.arange(rows)
    state_out = state_in if tokens == 1 else rows + torch.arange(rows * tokens).view(rows, tokens)
    qs = [r * tokens for r in range(rows + 1)]
    return StepBatch(
        token_ids=torch.randint(100, 500, (rows * tokens,), generator=gen).to(device),
        positions=new.repeat(rows).expand(3, -1).to(device),
        query_start=torch.tensor(qs, dtype=torch.int32, device=device),
        context_lens=torch.full((rows,), context, dtype=torch.int32, device=device),
        block_table=torch.arange(rows * pages, dtype=torch.int32, device=device).view(rows, pages),
        slot_mapping=slots.to(device),
        state_in=state_in.to(device),
        state_out=state_out.to(device),
        fresh=torch.zeros(rows, dtype=torch.bool, device=device),
        tokens_per_row=tokens,
        query_start_host=tuple(qs),
        context_lens_host=(context,) * rows,
    )


def random_store(
    variant: Variant, rows: int, tokens: int, context: int, page_size: int, dtype: torch.dtype,
    device: torch.device,
) -> StateStore:  # fmt: skip
    """A store for `uniform_step`'s slots and pages, filled with random values."""
    slots = rows + (rows * tokens if tokens > 1 else 0)
    store = StateStore.allocate(variant, slots, rows * -(-context // page_size), page_size, dtype, device)
    gen = torch.Generator(device=device).manual_seed(7)
    for pool in (store.conv, store.rec, store.k_pages, store.v_pages):
        pool.copy_(torch.randn(pool.shape, generator=gen, device=device) * 0.5)
    return store
