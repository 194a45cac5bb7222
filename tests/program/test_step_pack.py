"""`StepBuilder.pack`: the packed step's host facts for rows that start mid-page, cross pages, and map
their pages in no particular order (the KV slot of position p is pages[p // page_size] * page_size +
p % page_size)."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from ninfer.targets.qwen3_6.impl.runtime.step import StepBuilder

PAGE = 8


def _seq(frontier: int, pages: list[int], index: int) -> SimpleNamespace:
    return SimpleNamespace(frontier=frontier, pages=pages, slot=2 * index, current=2 * index,
                           spare=2 * index + 1, handle=SimpleNamespace(index=index), rope_delta=0,
                           prompt_positions=None)  # fmt: skip


def _spares(seqs: list[SimpleNamespace]) -> list[int]:
    return [s.spare for s in seqs]


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
    packed = builder.pack(seqs, inputs, state_out=_spares(seqs))
    fields = packed.fields()
    want_positions = [p for f, n in rows for p in range(f, f + n)]
    assert fields.positions.tolist() == want_positions
    assert fields.slot_mapping.tolist() == [pages[p // PAGE] * PAGE + p % PAGE for p in want_positions]
    assert fields.token_ids.tolist() == [t for row in inputs for t in row]
    assert fields.query_start.tolist() == [0, 77, 78, 80, 95] == list(packed.query_start_host)
    assert fields.context_lens.tolist() == [77, 14, 9, 24] == list(packed.context_lens_host)
    assert fields.state_out.tolist() == [s.spare for s in seqs]
    assert fields.fresh.tolist() == [1, 0, 0, 0]


def test_decode_rows_take_the_short_path_to_the_same_layout() -> None:
    """One token per row (a decode round): `uniform_values`, which the decode graph writes into its
    staging buffer, and `pack` over the same rows give the layout the general packing gives, field by
    field, at page starts, page ends and mid-page."""
    rng = random.Random(1)
    pages = list(range(40))
    rng.shuffle(pages)
    builder = StepBuilder(PAGE, torch.zeros(5, 40, dtype=torch.int32))
    frontiers = [0, PAGE - 1, PAGE, 3 * PAGE + 5, 39 * PAGE + PAGE - 1]
    seqs = [_seq(f, pages, i) for i, f in enumerate(frontiers)]
    tokens = [7, 11, 13, 17, 19]
    for write_spare in (True, False):
        outs = _spares(seqs) if write_spare else [s.slot for s in seqs]
        values = builder.uniform_values(seqs, tokens, 1, state_in=[s.slot for s in seqs], state_out=outs)
        packed = builder.pack(seqs, [[t] for t in tokens], state_out=outs)
        assert packed.values.tolist() == values
        assert packed.is_decode and packed.num_rows == len(seqs)
        f = packed.fields()
        assert f.token_ids.tolist() == tokens
        assert f.positions.tolist() == frontiers
        assert f.slot_mapping.tolist() == [pages[p // PAGE] * PAGE + p % PAGE for p in frontiers]
        assert f.query_start.tolist() == list(range(len(seqs) + 1)) == list(packed.query_start_host)
        assert f.context_lens.tolist() == [p + 1 for p in frontiers] == list(packed.context_lens_host)
        assert f.state_in.tolist() == [s.slot for s in seqs]
        assert f.state_out.tolist() == [s.spare if write_spare else s.slot for s in seqs]
        assert f.fresh.tolist() == [1, 0, 0, 0, 0]
        assert f.sequence_index.tolist() == list(range(len(seqs)))


def test_unpack_on_the_host_gives_the_step_batch_fields() -> None:
    """`unpack` off CUDA (the torch path; CUDA takes `ninfer.ops.triton.step_unpack`, tested against the
    same expressions): the casts, the table rows of the rows' sequence indices, views of the rest."""
    rng = random.Random(2)
    pages = list(range(40))
    rng.shuffle(pages)
    tables = torch.randint(0, 1000, (5, 37), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    builder = StepBuilder(PAGE, tables)
    seqs = [_seq(f, pages, i) for i, f in zip((3, 0, 4), (9, 0, 17))]
    for inputs in ([[5], [6], [7]], [[1, 2, 3], [4], [5, 6]]):  # a decode, then a prefill-like step
        packed = builder.pack(seqs, inputs, state_out=_spares(seqs))
        f = packed.fields()
        batch = builder.unpack(packed)
        assert batch.token_ids is f.token_ids and batch.slot_mapping is f.slot_mapping
        assert batch.state_in is f.state_in and batch.state_out is f.state_out
        assert torch.equal(batch.positions, f.positions.expand(3, -1))
        assert batch.query_start.dtype == batch.context_lens.dtype == batch.block_table.dtype == torch.int32
        assert batch.query_start.tolist() == list(packed.query_start_host) == batch.query_bounds()
        assert batch.context_lens.tolist() == list(packed.context_lens_host) == batch.context_lengths()
        assert torch.equal(batch.block_table, tables[[3, 0, 4]])
        assert batch.fresh.dtype == torch.bool and batch.fresh.tolist() == [False, True, False]
        assert batch.inputs_embeds is None


def test_unpack_feeds_the_negative_token_ids_of_a_decode() -> None:
    """A decode graph's rows fed on the device: a packed token id of -1 takes the feed's entry."""
    tables = torch.zeros(5, 4, dtype=torch.int32)
    builder = StepBuilder(PAGE, tables)
    seqs = [_seq(f, list(range(40)), i) for i, f in zip((3, 0, 4), (9, 0, 17))]
    feed = torch.tensor([70, 71, 72])
    packed = builder.pack(seqs, [[-1], [6], [-1]], state_out=_spares(seqs))
    assert builder.unpack(packed, feed).token_ids.tolist() == [70, 6, 72]
    assert builder.unpack(packed).token_ids.tolist() == [-1, 6, -1]
    with pytest.raises(ValueError, match="only a decode"):
        builder.unpack(builder.pack(seqs, [[1, 2], [3], [4]], state_out=_spares(seqs)), feed)


def test_fused_unpack_needs_cuda_tables_and_is_off_by_default() -> None:
    """The Triton unpack is the fast op table's (the Program asks for it there, on CUDA only)."""
    with pytest.raises(ValueError, match="fused_unpack needs the block tables on CUDA"):
        StepBuilder(PAGE, torch.zeros(2, 4, dtype=torch.int32), fused_unpack=True)
    assert not StepBuilder(PAGE, torch.zeros(2, 4, dtype=torch.int32)).fused_unpack


def _at_capacity(packed, values: list[int], capacity: int):  # type: ignore[no-untyped-def]
    """The packed step a prefill graph's static input holds after `padded_values`."""
    return dataclasses.replace(
        packed, values=torch.tensor(values), num_tokens=capacity, query_start_host=(0, capacity), padded=True,
        axes=3,
    )  # fmt: skip


def test_a_chunk_laid_out_at_a_capacity_keeps_its_facts_and_pads_after_them() -> None:
    """`padded_values` (a prefill graph's input): the chunk's fields unchanged and in order, then padding
    tokens that write no KV (slot -1); the row's bounds and context stay the chunk's, and the unpacked
    step is `padded` with the capacity's token count; a text chunk's H/W rotary axes are its positions."""
    pages = [5, 2, 9, 4]
    builder = StepBuilder(PAGE, torch.zeros(3, 40, dtype=torch.int32))
    seq = _seq(11, pages, 1)
    chunk = [300 + t for t in range(13)]
    packed = builder.pack([seq], [chunk], state_out=[seq.spare])
    values = StepBuilder.padded_values(packed, 32)
    want = packed.fields()
    capacity = _at_capacity(packed, values, 32)
    got = capacity.fields()
    assert got.token_ids.tolist() == chunk + [0] * 19
    assert got.positions.tolist() == list(range(11, 43))
    assert capacity.positions_hw is not None
    assert capacity.positions_hw.tolist() == [list(range(11, 43))] * 2
    assert got.slot_mapping.tolist() == want.slot_mapping.tolist() + [-1] * 19
    assert got.query_start.tolist() == [0, 13]
    assert got.context_lens.tolist() == [24]
    for name in ("state_in", "state_out", "fresh", "sequence_index"):
        assert getattr(got, name).tolist() == getattr(want, name).tolist()
    batch = builder.unpack(capacity)
    assert batch.padded and batch.num_tokens == 32 and batch.query_bounds() == [0, 32]
    assert batch.query_start.tolist() == [0, 13]
    assert batch.positions.tolist() == [list(range(11, 43))] * 3
    with pytest.raises(ValueError, match="at most 8 tokens"):
        StepBuilder.padded_values(packed, 8)
    two = builder.pack([seq, _seq(0, pages, 2)], [chunk, chunk], state_out=[1, 2])
    with pytest.raises(ValueError, match="one row"):
        StepBuilder.padded_values(two, 32)


def test_a_chunk_of_a_prompt_with_images_keeps_its_rotary_axes_at_a_capacity() -> None:
    """A chunk of a prompt with images (three M-RoPE axes of its own) laid out at a capacity: the T, H
    and W positions are the prompt's, each continued by the padding."""
    prompt_positions = [list(range(20)), [0] * 5 + [5, 5, 6, 6] + list(range(7, 18)), list(range(3, 23))]
    seq = SimpleNamespace(**{**vars(_seq(4, [1, 3, 0], 0)), "prompt": tuple(range(20)),
                             "prompt_positions": prompt_positions})  # fmt: skip
    seq.rope_positions = lambda a, b: tuple(axis[a:b] for axis in prompt_positions)
    builder = StepBuilder(PAGE, torch.zeros(1, 3, dtype=torch.int32))
    packed = builder.pack([seq], [list(range(100, 110))], state_out=[seq.spare])
    assert packed.axes == 3
    capacity = _at_capacity(packed, StepBuilder.padded_values(packed, 16), 16)
    batch = builder.unpack(capacity)
    want = [axis[4:14] + list(range(axis[13] + 1, axis[13] + 7)) for axis in prompt_positions]
    assert batch.positions.tolist() == want
    assert capacity.fields().slot_mapping.tolist()[10:] == [-1] * 6


def test_the_capture_placeholder_is_a_fresh_row_on_page_zero() -> None:
    packed = StepBuilder.placeholder_chunk(16, PAGE, 3, torch.device("cpu"))
    f = packed.fields()
    assert packed.padded and packed.num_tokens == 16 and packed.query_start_host == (0, 16)
    assert packed.axes == 3 and packed.values.shape[0] == packed.base_length + 2 * 16
    assert f.slot_mapping.tolist() == [i % PAGE for i in range(16)]
    assert f.query_start.tolist() == [0, 16] and f.context_lens.tolist() == [16]
    assert f.state_in.tolist() == f.state_out.tolist() == [3] and f.fresh.tolist() == [1]
