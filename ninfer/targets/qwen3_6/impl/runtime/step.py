"""Turn a unit's rows (sequence + input tokens + state slots) into the model's `StepBatch` tensors.

Rows, slots and pages are plain data here: the same builder serves prefill chunks, decode rounds,
speculative verifies and forced control. The caller (the Program and its decode backend) chooses every
row's state slots; the builder lays out the rest from the sequences' frontiers and pages.

A step's host facts travel as one packed int64 vector (`StepFields`: token ids, positions, KV slots, row
bounds, context lengths, state slots, fresh flags, sequence indices) in one host-to-device copy, then
two optional tails: the per-position state slots of a step of T tokens per row (``[B, T]``, a verify)
and the H/W rotary positions of a prompt chunk with images (``[2, N]``; otherwise the three M-RoPE axes
are equal). `unpack` turns the device copy into the `StepBatch` views, gathering the rows' block tables
from the device-resident table (one row per sequence index, written at materialization); with the fast
op table the casts and the gather are one Triton launch (`ninfer.ops.triton.step_unpack`, over the base
fields). A captured step graph runs `unpack` inside the graph over its static packed buffer, so a decode
step costs the host one copy and one replay. Steps of T tokens for every row (decode T = 1, a verify
T = K + 1) have a short path to the same layout, `uniform_values`, which a graph writes straight into
its pinned staging buffer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StepBatch


class StepFields(NamedTuple):
    """The packed vector's base fields, in order (views of it)."""

    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N] the M-RoPE temporal (text) position of each token
    slot_mapping: torch.Tensor  # [N]
    query_start: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B] after the step
    state_in: torch.Tensor  # [B]
    state_out: torch.Tensor  # [B] the slot of each row's final state
    fresh: torch.Tensor  # [B] 0/1
    sequence_index: torch.Tensor  # [B] the row's sequence index (block table and penalty rows)


@dataclass(frozen=True)
class PackedStep:
    """A step's facts as one int64 vector, on the host (`pack`) or on the device (`to_device`).

    ``tokens_per_row``: T when every row has T tokens (a uniform step), else None. ``per_position``: the
    vector's first tail holds [B, T] state slots (the state after each token). ``axes``: 3 when the
    second tail holds the H and W rotary positions, 1 when all three axes are the base positions.
    ``padded``: one row whose tokens from its packed query_start[-1] on are padding (a prefill graph's
    capacity; the host copies are the capacity's bounds, `StepBatch.padded`).
    """

    values: torch.Tensor
    num_tokens: int
    num_rows: int
    query_start_host: tuple[int, ...]  # host copies of two fields, for the prefill ops' launch sizes
    context_lens_host: tuple[int, ...]
    tokens_per_row: int | None = None
    per_position: bool = False
    axes: int = 1
    padded: bool = False

    @property
    def base_length(self) -> int:
        return 3 * self.num_tokens + 6 * self.num_rows + 1

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_rows

    @functools.cached_property
    def _fields(self) -> StepFields:
        n, b = self.num_tokens, self.num_rows
        return StepFields(*self.values[: self.base_length].split([n, n, n, b + 1, b, b, b, b, b]))

    def fields(self) -> StepFields:
        """Views of `values`, made once (a graph's static input serves every replay)."""
        return self._fields

    @functools.cached_property
    def position_slots(self) -> torch.Tensor | None:
        """[B, T] per-position state slots (a view of the first tail), or None."""
        if not self.per_position:
            return None
        start, b, t = self.base_length, self.num_rows, self.tokens_per_row or 1
        return self.values[start : start + b * t].view(b, t)

    @functools.cached_property
    def positions_hw(self) -> torch.Tensor | None:
        """[2, N] H and W rotary positions (a view of the last tail), or None."""
        if self.axes == 1:
            return None
        start = self.base_length + (self.num_rows * (self.tokens_per_row or 1) if self.per_position else 0)
        return self.values[start : start + 2 * self.num_tokens].view(2, self.num_tokens)


def pinned_ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Host ints as a long device tensor, through pinned memory on CUDA: a copy from pageable memory
    would wait for the device queue to drain, and the callers queue behind running steps."""
    ids = torch.tensor(list(values), dtype=torch.long)
    if device.type == "cuda":
        ids = ids.pin_memory()
    return ids.to(device, non_blocking=True)


def host_copy(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``values`` on their way to the host behind the work queued so far (from CUDA a copy into pinned
    memory, not waited on), and the event that marks them landed (None off CUDA: the copy is done)."""
    host = values.to("cpu", non_blocking=True)
    if not values.is_cuda:
        return host, None
    done = torch.cuda.Event()
    done.record()
    return host, done


class StepBuilder:
    def __init__(self, page_size: int, block_tables: torch.Tensor, *, fused_unpack: bool = False) -> None:
        """``fused_unpack``: `unpack`'s casts and table gather in one Triton launch (the fast op table, on
        CUDA); otherwise the plain torch expressions (the reference table keeps Triton out entirely)."""
        if fused_unpack and block_tables.device.type != "cuda":
            raise ValueError(f"fused_unpack needs the block tables on CUDA, not {block_tables.device}")
        self.page_size = page_size
        self.block_tables = block_tables  # [max_sequences, max_pages] int32, on the device
        self.device = block_tables.device
        self.fused_unpack = fused_unpack

    def pack(
        self,
        seqs: Sequence[SequenceState],
        inputs: Sequence[Sequence[int]],
        *,
        state_out: Sequence[int],
        state_in: Sequence[int] | None = None,
    ) -> PackedStep:
        """Row r feeds ``inputs[r]`` at positions ``frontier..frontier+len-1`` of ``seqs[r]``, reading GDN
        state from ``state_in[r]`` (default: the sequence's current slot) and writing its final state to
        ``state_out[r]``. Rows of one token each take `uniform_values`' layout."""
        state_in = [s.current for s in seqs] if state_in is None else state_in
        if all(len(row) == 1 for row in inputs):
            tokens = [row[0] for row in inputs]
            values = self.uniform_values(seqs, tokens, 1, state_in=state_in, state_out=state_out)
            return _packed(values, len(seqs), range(len(seqs) + 1), [s.frontier + 1 for s in seqs], 1)
        ps = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        hw: list[list[int]] = [[], []]
        slot_mapping: list[int] = []
        query_start = [0]
        axes = 3 if any(s.prompt_positions is not None for s in seqs) else 1
        for seq, row in zip(seqs, inputs):
            start, end = seq.frontier, seq.frontier + len(row)
            tokens.extend(map(int, row))
            if axes == 3:
                rope = seq.rope_positions(start, end)
                positions.extend(rope[0])
                hw[0].extend(rope[1])
                hw[1].extend(rope[2])
            else:
                positions.extend(range(start + seq.rope_delta, end + seq.rope_delta))
            # KV slots page by page: a run of consecutive slots per page (an 8192-token prompt is 128 runs,
            # not 8192 divisions)
            for page in range(start // ps, (end - 1) // ps + 1):
                first, stop = max(start, page * ps), min(end, (page + 1) * ps)
                offset = seq.pages[page] * ps - page * ps  # slot of position p on this page: offset + p
                slot_mapping.extend(range(offset + first, offset + stop))
            query_start.append(len(tokens))
        context_lens = [s.frontier + len(row) for s, row in zip(seqs, inputs)]
        values = _layout(
            tokens,
            positions,
            slot_mapping,
            query_start,
            context_lens=context_lens,
            state_in=list(state_in),
            state_out=list(state_out),
            fresh=[int(s.frontier == 0) for s in seqs],  # start from zero GDN state
            sequence_index=[s.handle.index for s in seqs],
        )
        if axes == 3:
            values += hw[0] + hw[1]
        return _packed(values, len(tokens), query_start, context_lens, None, axes=axes)

    def uniform_values(
        self,
        seqs: Sequence[SequenceState],
        tokens: Sequence[int],
        tokens_per_row: int,
        *,
        state_in: Sequence[int],
        state_out: Sequence[int] | Sequence[Sequence[int]],
        offset: int = 0,
    ) -> list[int]:
        """The packed values of a step of T = ``tokens_per_row`` tokens for every row, as a plain list: the
        decode round's short path (no per-page loop, no tensor).

        ``tokens`` [B*T] row-major; row r feeds its T tokens at positions ``frontier + offset ..`` of
        ``seqs[r]`` (``offset=1``: the decode after one not yet committed, the Program's lookahead),
        reading ``state_in[r]``. ``state_out[r]`` is the slot of its final state (T = 1) or the T slots of
        the state after each token (T > 1: the per-position tail)."""
        ps, t = self.page_size, tokens_per_row
        starts = [s.frontier + offset for s in seqs]
        if t == 1:
            positions = [p + s.rope_delta for s, p in zip(seqs, starts)]
            slots = [s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, starts)]
            final = list(state_out)
        else:
            positions = [p + s.rope_delta + i for s, p in zip(seqs, starts) for i in range(t)]
            slots = [s.pages[q // ps] * ps + q % ps for s, p in zip(seqs, starts) for q in range(p, p + t)]
            final = [row[-1] for row in state_out]  # type: ignore[index]
        values = _layout(
            [int(x) for x in tokens],
            positions,
            slots,
            list(range(0, len(seqs) * t + 1, t)),
            context_lens=[p + t for p in starts],
            state_in=list(state_in),
            state_out=final,
            fresh=[int(p == 0) for p in starts],
            sequence_index=[s.handle.index for s in seqs],
        )
        if t > 1:
            values += [slot for row in state_out for slot in row]  # type: ignore[union-attr]
        return values

    @staticmethod
    def placeholder(
        num_rows: int, tokens_per_row: int, scratch_slot: int, device: torch.device
    ) -> PackedStep:
        """A uniform step for graph capture: every row reads and writes ``scratch_slot`` and KV slot 0 of
        page 0 (which no committed state depends on), sequence index 0's table row."""
        b, t = num_rows, tokens_per_row
        n, zeros = b * t, [0] * (b * t)
        values = _layout(
            zeros,
            list(range(t)) * b,
            zeros,
            list(range(0, n + 1, t)),
            context_lens=[t] * b,
            state_in=[scratch_slot] * b,
            state_out=[scratch_slot] * b,
            fresh=[0] * b,
            sequence_index=[0] * b,
        )
        if t > 1:
            values += [scratch_slot] * n
        packed = _packed(values, n, range(0, n + 1, t), [t] * b, t)
        return dataclasses.replace(packed, values=packed.values.to(device))

    @staticmethod
    def placeholder_chunk(
        capacity: int, page_size: int, scratch_slot: int, device: torch.device
    ) -> PackedStep:
        """A one-row prefill chunk of ``capacity`` tokens for graph capture (`padded`, none of them padding
        here): a fresh row that writes ``scratch_slot`` and the slots of KV page 0 (which no committed
        state depends on at capture), reading only page 0 (sequence index 0's table row, all zeros). It
        carries the H/W rotary tail (``axes`` 3), so one graph serves text chunks and chunks of prompts
        with images."""
        t = capacity
        values = _layout(
            [0] * t,
            list(range(t)),
            [i % page_size for i in range(t)],
            [0, t],
            context_lens=[t],
            state_in=[scratch_slot],
            state_out=[scratch_slot],
            fresh=[1],
            sequence_index=[0],
        )
        values += list(range(t)) * 2
        packed = dataclasses.replace(_packed(values, t, (0, t), (t,), None, axes=3), padded=True)
        return dataclasses.replace(packed, values=packed.values.to(device))

    @staticmethod
    def padded_values(packed: PackedStep, capacity: int) -> list[int]:
        """A one-row prefill chunk's packed values (`pack`) laid out at ``capacity`` tokens, as
        `placeholder_chunk` lays them: its n tokens, then padding (token 0 at the positions that follow,
        KV slot -1: never cached); the row bounds stay [0, n]; the H/W rotary tail is the chunk's own (a
        prompt with images) or its base positions (text), padded the same way."""
        n = packed.num_tokens
        if packed.num_rows != 1 or packed.tokens_per_row is not None or n > capacity:
            raise ValueError(f"a prefill graph takes one row of at most {capacity} tokens")
        f = [t.tolist() for t in packed.fields()]
        hw = packed.positions_hw
        h, w = (f[1], f[1]) if hw is None else hw.tolist()
        pad = capacity - n

        def padded(axis: list[int]) -> list[int]:
            return axis + list(range(axis[-1] + 1, axis[-1] + 1 + pad))

        values = _layout(
            f[0] + [0] * pad,
            padded(f[1]),
            f[2] + [-1] * pad,
            f[3],
            context_lens=f[4],
            state_in=f[5],
            state_out=f[6],
            fresh=f[7],
            sequence_index=f[8],
        )
        return values + padded(h) + padded(w)

    def uniform_step(self, values: list[int], num_rows: int, tokens_per_row: int) -> PackedStep:
        """The host `PackedStep` over `uniform_values`' list."""
        t = tokens_per_row
        contexts = values[3 * num_rows * t + num_rows + 1 : 3 * num_rows * t + 2 * num_rows + 1]
        return _packed(values, num_rows * t, range(0, num_rows * t + 1, t), contexts, t)

    def to_device(self, packed: PackedStep) -> PackedStep:
        values = packed.values
        if self.device.type == "cuda":  # a copy from pageable memory would first drain the GPU queue
            values = values.pin_memory()
        return dataclasses.replace(packed, values=values.to(self.device, non_blocking=True))

    def unpack(self, packed: PackedStep, feed: torch.Tensor | None = None) -> StepBatch:
        """The `StepBatch` over ``packed`` (on the device): views and a few device ops, no host sync (with
        ``fused_unpack`` one Triton launch for the casts and the table gather, `step_unpack.unpack_step`).

        ``feed`` ([B] int64 on the device, a decode only): a row whose packed token id is negative takes
        ``feed[row]`` (a decode graph's tokens drawn by its previous replay, `graphs.StepGraphs`)."""
        f = packed.fields()
        token_ids = f.token_ids
        if feed is not None and not packed.is_decode:
            raise ValueError("only a decode (one token per row) takes fed tokens")
        if self.fused_unpack:  # one launch in place of four small kernels per decode step
            from ninfer.ops.triton.step_unpack import unpack_step

            query_start, context_lens, block_table, fresh, fed = unpack_step(
                packed.values[: packed.base_length], packed.num_tokens, packed.num_rows, self.block_tables,
                feed,
            )  # fmt: skip
            token_ids = token_ids if fed is None else fed
        else:
            query_start, context_lens = f.query_start.int(), f.context_lens.int()
            block_table = self.block_tables.index_select(0, f.sequence_index)
            fresh = f.fresh.bool()
            if feed is not None:
                token_ids = torch.where(token_ids < 0, feed, token_ids)
        hw = packed.positions_hw
        positions = f.positions.expand(3, -1) if hw is None else torch.cat((f.positions.unsqueeze(0), hw))
        slots = packed.position_slots
        return StepBatch(
            token_ids=token_ids,
            positions=positions,
            query_start=query_start,
            context_lens=context_lens,
            block_table=block_table,
            slot_mapping=f.slot_mapping,
            state_in=f.state_in,
            state_out=f.state_out if slots is None else slots,
            fresh=fresh,
            tokens_per_row=packed.tokens_per_row,
            query_start_host=packed.query_start_host,
            context_lens_host=packed.context_lens_host,
            padded=packed.padded,
        )


def _packed(
    values: list[int],
    num_tokens: int,
    query_start: Sequence[int],
    context_lens: Sequence[int],
    tokens_per_row: int | None,
    *,
    axes: int = 1,
) -> PackedStep:
    """The host `PackedStep` over ``values`` (`_layout` and its tails), with host copies of two fields."""
    rows = len(context_lens)
    per_position = tokens_per_row is not None and tokens_per_row > 1
    return PackedStep(
        torch.tensor(values, dtype=torch.long),
        num_tokens,
        rows,
        tuple(query_start),
        tuple(context_lens),
        tokens_per_row=tokens_per_row,
        per_position=per_position,
        axes=axes,
    )


def _layout(
    tokens: list[int],
    positions: list[int],
    slot_mapping: list[int],
    query_start: list[int],
    *,
    context_lens: list[int],
    state_in: list[int],
    state_out: list[int],
    fresh: list[int],
    sequence_index: list[int],
) -> list[int]:
    """The one place the layout of `StepFields` is written."""
    return (
        tokens + positions + slot_mapping + query_start + context_lens + state_in + state_out + fresh
        + sequence_index
    )  # fmt: skip
