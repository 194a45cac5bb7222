"""`StepBuilder.pack`: the packed step's host facts for rows that start mid-page, cross pages, and map
their pages in no particular order (the KV slot of position p is pages[p // page_size] * page_size +
p % page_size)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from ninfer.targets.qwen3_6.impl.runtime.step import StepBuilder

PAGE = 8


def _seq(frontier: int, pages: list[int], index: int) -> SimpleNamespace:
    return SimpleNamespace(frontier=frontier, pages=pages, slot=2 * index, spare=2 * index + 1,
                           handle=SimpleNamespace(index=index))  # fmt: skip


def test_pack_maps_every_position_to_its_page_slot() -> None:
    rng = random.Random(0)
    pages = list(range(40))
    rng.shuffle(pages)
    builder = StepBuilder(PAGE, torch.zeros(3, 40, dtype=torch.int32))
    # (frontier, tokens): a whole prompt over many pages, one token mid-page, one crossing a boundary,
    # one ending exactly on a boundary
    rows = [(0, 77), (13, 1), (7, 2), (9, 15)]
    seqs = [_seq(f, pages, i % 3) for i, (f, _) in enumerate(rows)]
    inputs = [[1000 + 10 * i + t for t in range(n)] for i, (_, n) in enumerate(rows)]
    packed = builder.pack(seqs, inputs, write_spare=True)
    fields = packed.fields()
    want_positions = [p for f, n in rows for p in range(f, f + n)]
    assert fields.positions.tolist() == want_positions
    assert fields.slot_mapping.tolist() == [pages[p // PAGE] * PAGE + p % PAGE for p in want_positions]
    assert fields.token_ids.tolist() == [t for row in inputs for t in row]
    assert fields.query_start.tolist() == [0, 77, 78, 80, 95] == list(packed.query_start_host)
    assert fields.context_lens.tolist() == [77, 14, 9, 24] == list(packed.context_lens_host)
    assert fields.state_out.tolist() == [s.spare for s in seqs]
    assert fields.fresh.tolist() == [1, 0, 0, 0]
