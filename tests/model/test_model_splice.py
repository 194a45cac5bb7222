"""The forward's embedding splice (image features at their pad tokens) in its two forms: the index form
(eager prefill chunks) and the dense mask form (a prefill graph's static buffers) give the logits of the
same embeddings handed in whole (``inputs_embeds``); the forms are exclusive."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from qwen3_6_model_harness import RowStep, make_batch, tiny_view

from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward

PAGE = 16


def _logits(view, batch: StepBatch) -> torch.Tensor:  # type: ignore[no-untyped-def]
    store = StateStore.allocate(view.variant, 2, 3, PAGE, torch.float32, "cpu")
    with torch.no_grad():
        out = forward(view, view.variant, batch, store, logits="all")
    assert out.logits is not None
    return out.logits


def test_index_and_mask_splices_equal_whole_embeddings() -> None:
    view = tiny_view("qwen3_6_tiny")
    tokens = list(range(5, 25))
    batch = make_batch([RowStep(tokens, 0, [1, 2], 0, 1, fresh=True)], PAGE)
    rows = torch.tensor([3, 4, 5, 11])
    feats = torch.randn(len(rows), view.variant.hidden_size, generator=torch.Generator().manual_seed(2))
    whole = F.embedding(torch.tensor(tokens), view.text.embed).index_copy(0, rows, feats)
    mask = torch.zeros(len(tokens), dtype=torch.bool).index_fill(0, rows, True)
    dense = torch.randn(len(tokens), view.variant.hidden_size).index_copy(0, rows, feats)  # other rows unread

    want = _logits(view, dataclasses.replace(batch, inputs_embeds=whole))
    by_index = _logits(view, dataclasses.replace(batch, splice_index=rows, splice_embeds=feats))
    by_mask = _logits(view, dataclasses.replace(batch, splice_mask=mask, splice_embeds=dense))
    plain = _logits(view, batch)
    torch.testing.assert_close(by_index, want, rtol=0, atol=0)
    torch.testing.assert_close(by_mask, want, rtol=0, atol=0)
    assert (plain - want).abs().max() > 1e-3  # the splice changes the output (negative control)


def test_splice_forms_are_exclusive() -> None:
    batch = make_batch([RowStep([1, 2, 3], 0, [1], 0, 1, fresh=True)], PAGE)
    rows, feats, mask = torch.tensor([1]), torch.zeros(1, 8), torch.zeros(3, dtype=torch.bool)
    with pytest.raises(ValueError, match="two forms of one splice"):
        dataclasses.replace(batch, splice_index=rows, splice_mask=mask, splice_embeds=feats)
    with pytest.raises(ValueError, match="splice_embeds comes with"):
        dataclasses.replace(batch, splice_mask=mask)
    with pytest.raises(ValueError, match="splice_embeds comes with"):
        dataclasses.replace(batch, splice_embeds=feats)
