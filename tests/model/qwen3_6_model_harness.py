"""Shared helpers of the tests/model tests: random views, the transformers oracle, step-batch building.

Imported by the test modules of this folder (pytest puts the folder on sys.path). transformers is
imported lazily so the GPU test runs on machines with another transformers version.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.targets.qwen3_6.binder import hf_state_dict, random_model_view
from ninfer.targets.qwen3_6.model import ForwardOutput, StateStore, StepBatch, forward
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.registry import PACKAGES

TINY_PACKAGES = ("qwen3_6_tiny", "qwen3_6_tiny_moe")
SEED = 1234


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max|a - b| / max|b|, in fp32."""
    actual, expected = actual.float().cpu(), expected.float().cpu()
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@functools.cache
def tiny_view(package_name: str) -> ModelView:
    """fp32 CPU random view of a tiny package (cached: the 248,320-row embedding takes a moment)."""
    return random_model_view(PACKAGES[package_name].variant, seed=SEED, dtype=torch.float32, device="cpu")


@functools.cache
def hf_model(package_name: str) -> torch.nn.Module:
    """transformers' Qwen3_5(Moe)ForCausalLM of the package's text config holding `tiny_view`'s weights."""
    from transformers import (
        Qwen3_5ForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
    )

    package = PACKAGES[package_name]
    text_config = package.hf_config()["text_config"]
    if package.variant.moe:
        config, model_cls = Qwen3_5MoeTextConfig(**text_config), Qwen3_5MoeForCausalLM
    else:
        config, model_cls = Qwen3_5TextConfig(**text_config), Qwen3_5ForCausalLM
    config._attn_implementation = "eager"  # fp32 softmax, no SDPA kernel differences
    model = model_cls(config).float().eval()
    model.load_state_dict(hf_state_dict(tiny_view(package_name), text_only=True), strict=True)
    return model


def hf_logits(package_name: str, token_ids: Sequence[int]) -> torch.Tensor:
    """The oracle's fp32 logits [T, V] for one sequence, full forward without a cache."""
    with torch.no_grad():
        out = hf_model(package_name)(input_ids=torch.tensor([list(token_ids)]), use_cache=False)
    return out.logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 248320) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass(frozen=True)
class RowStep:
    """One row of a step: ``tokens`` continue a sequence that already has ``past`` tokens in state/KV."""

    tokens: Sequence[int]
    past: int
    pages: Sequence[int]  # the sequence's KV pages, in order, covering past + len(tokens)
    state_in: int
    state_out: int
    fresh: bool = False


def make_batch(rows: Sequence[RowStep], page_size: int, device: torch.device | str = "cpu") -> StepBatch:
    """Flatten rows into a StepBatch the way a Program would (text positions, slots from pages)."""
    token_ids, positions, slots, starts = [], [], [], [0]
    max_pages = max(len(r.pages) for r in rows)
    for r in rows:
        assert len(r.pages) * page_size >= r.past + len(r.tokens), "row needs more pages"
        for pos in range(r.past, r.past + len(r.tokens)):
            positions.append(pos)
            slots.append(r.pages[pos // page_size] * page_size + pos % page_size)
        token_ids += list(r.tokens)
        starts.append(starts[-1] + len(r.tokens))
    table = [list(r.pages) + [0] * (max_pages - len(r.pages)) for r in rows]

    def t(data: object, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=device)

    return StepBatch(
        token_ids=t(token_ids, torch.long),
        positions=t(positions, torch.long).expand(3, -1).contiguous(),
        query_start=t(starts, torch.int32),
        context_lens=t([r.past + len(r.tokens) for r in rows], torch.int32),
        block_table=t(table, torch.int32),
        slot_mapping=t(slots, torch.long),
        state_in=t([r.state_in for r in rows], torch.long),
        state_out=t([r.state_out for r in rows], torch.long),
        fresh=t([r.fresh for r in rows], torch.bool),
    )


def run_step(
    view: ModelView,
    store: StateStore,
    rows: Sequence[RowStep],
    *,
    logits: str = "last",
) -> ForwardOutput:
    batch = make_batch(rows, store.page_size, device=store.conv.device)
    with torch.no_grad():
        return forward(view, view.variant, batch, store, logits=logits)  # type: ignore[arg-type]


def clone_store(store: StateStore) -> StateStore:
    return StateStore(
        conv=store.conv.clone(),
        rec=store.rec.clone(),
        k_pages=store.k_pages.clone(),
        v_pages=store.v_pages.clone(),
    )


class SeqState:
    """Test-side bookkeeping of one sequence in a StateStore: its token history, pages, GDN slot."""

    def __init__(self, pages: Sequence[int], slot: int) -> None:
        self.pages = list(pages)
        self.slot = slot  # slot the next step reads (a fresh sequence's first step ignores it)
        self.history: list[int] = []

    def row(self, tokens: Sequence[int], next_slot: int) -> RowStep:
        return RowStep(
            list(tokens), len(self.history), self.pages, self.slot, next_slot, fresh=not self.history
        )


def step(
    view: ModelView, store: StateStore, feeds: Sequence[tuple[SeqState, Sequence[int], int]]
) -> torch.Tensor:
    """Run one batch of (sequence, new tokens, slot to write) rows; returns last-token logits [B, V]."""
    out = run_step(view, store, [seq.row(tokens, next_slot) for seq, tokens, next_slot in feeds])
    for seq, tokens, next_slot in feeds:
        seq.history += list(tokens)
        seq.slot = next_slot
    assert out.logits is not None
    return out.logits
