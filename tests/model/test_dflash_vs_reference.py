"""The DFlash drafter's math (`ninfer.targets.qwen3_6.dflash`) against z-lab's reference model
(`dflash==0.1.0`, `DFlashDraftModel`), fp32, on both tiny packages' drafters (one causal sliding-window
layer, one bidirectional full layer).

- A block after a context: our context K/V written into pages, then the block through paged attention,
  equals the reference's forward over [context; block] at every block position, for contexts shorter
  and longer than the sliding window, and in pages of several sizes (a block straddling page ends).
- The window matters (negative control): a drafter whose sliding layer sees the whole context differs.
- The taps: the text model's tap-layer outputs equal transformers' ``hidden_states[i + 1]``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_artifacts import hf_causal_lm, reference_drafter, tiny_view

from ninfer.targets.qwen3_6 import dflash
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward
from ninfer.targets.qwen3_6.view import ModelView

pytest.importorskip("dflash.model")  # the oracle (`tiny_artifacts.reference_drafter`)

PACKAGES_WITH_DRAFTERS = ("qwen3_6_tiny", "qwen3_6_tiny_moe")


def ours(view: ModelView, taps: torch.Tensor, block_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Context K/V of positions 0..L-1 from ``taps`` [L, n*H], then the block at L..L+T-1."""
    dims = view.variant.dflash
    assert dims is not None
    ctx, t = taps.shape[0], block_ids.shape[0]
    total = ctx + t
    pages = -(-total // page_size) + 1
    store = StateStore.allocate_kv(
        view.variant,
        dims.num_layers,
        pages,
        page_size,
        torch.float32,
        "cpu",
        (dims.num_kv_heads, dims.head_dim),
    )
    order = torch.randperm(pages - 1, generator=torch.Generator().manual_seed(3)) + 1  # pages out of order
    table = order[None, :].int()

    def slots(positions: torch.Tensor) -> torch.Tensor:
        return table[0, positions // page_size].long() * page_size + positions % page_size

    positions = torch.arange(ctx)
    dflash.write_context(view, dflash.context_vectors(view, taps), positions, slots(positions), store)
    block_pos = torch.arange(ctx, total)
    return dflash.block(view, block_ids, block_pos, slots(block_pos), table, torch.tensor([total]), store)


def reference(
    model: torch.nn.Module, view: ModelView, taps: torch.Tensor, block_ids: torch.Tensor
) -> torch.Tensor:
    ctx, t = taps.shape[0], block_ids.shape[0]
    noise = torch.nn.functional.embedding(block_ids[None], view.text.embed)
    with torch.no_grad():
        return model(
            target_hidden=taps[None], noise_embedding=noise, position_ids=torch.arange(ctx + t)[None]
        )[0]


@pytest.mark.parametrize("name", PACKAGES_WITH_DRAFTERS)
@pytest.mark.parametrize(("ctx", "t", "page_size"), [(5, 4, 16), (23, 16, 8), (40, 7, 4), (1, 2, 16)])
def test_block_equals_the_reference(name: str, ctx: int, t: int, page_size: int) -> None:
    view = tiny_view(name, drafter=True)
    dims = view.variant.dflash
    assert dims is not None
    g = torch.Generator().manual_seed(ctx * 100 + t)
    taps = torch.randn(ctx, len(dims.target_layer_ids) * view.variant.hidden_size, generator=g)
    block_ids = torch.full((t,), dims.mask_token_id)
    block_ids[0] = 1234
    got = ours(view, taps, block_ids, page_size)
    want = reference(reference_drafter(view), view, taps, block_ids)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    if ctx + t > dims.sliding_window:  # negative control: the window decides the sliding layer's keys
        wide = dataclasses.replace(dims, sliding_window=10**6)
        wide_view = dataclasses.replace(view, variant=dataclasses.replace(view.variant, dflash=wide))
        assert (ours(wide_view, taps, block_ids, page_size) - want).abs().max() > 1e-3


@pytest.mark.parametrize("name", PACKAGES_WITH_DRAFTERS)
def test_taps_are_transformers_hidden_states(name: str) -> None:
    view = tiny_view(name, drafter=True)
    dims = view.variant.dflash
    assert dims is not None
    n = 11
    ids = torch.randint(0, 5000, (n,), generator=torch.Generator().manual_seed(5))
    variant = view.variant
    store = StateStore.allocate(variant, 1, 1, 16, torch.float32, "cpu")
    batch = StepBatch(
        token_ids=ids,
        positions=torch.arange(n).expand(3, -1),
        query_start=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.zeros(1, 1, dtype=torch.int32),
        slot_mapping=torch.arange(n),
        state_in=torch.zeros(1, dtype=torch.long),
        state_out=torch.zeros(1, dtype=torch.long),
        fresh=torch.ones(1, dtype=torch.bool),
        taps=dims.target_layer_ids,
    )
    out = forward(view, variant, batch, store, logits="none")
    with torch.no_grad():
        hf = hf_causal_lm(name)(ids[None], output_hidden_states=True).hidden_states
    for i in dims.target_layer_ids:
        torch.testing.assert_close(out.taps[i], hf[i + 1][0], rtol=1e-5, atol=1e-5)
