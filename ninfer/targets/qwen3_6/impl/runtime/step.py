"""Turn a unit's rows (sequence + input tokens) into the model's `StepBatch` tensors.

Rows, slots and pages are plain data here: the same builder serves prefill chunks, decode rounds and
forced control. A step's host facts travel as one packed int64 vector (`pack`: token ids, positions, KV
slots, row bounds, context lengths, state slots, fresh flags, sequence indices) in one host-to-device
copy; `unpack` turns the device copy into the `StepBatch` views, gathering the rows' block tables from
the device-resident table (one row per sequence index, written at materialization); with the fast op
table the casts and the gather are one Triton launch (`ninfer.ops.triton.step_unpack`). A captured
decode graph runs `unpack` inside the graph over its static packed buffer, so a decode step costs the
host one copy and one replay. A decode step (one token per row, the common case between two decode
rounds) has its own short path to the same layout, `decode_values`, which the graph writes straight
into its pinned staging buffer.
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
    """The packed vector's fields, in order (views of it)."""

    token_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N]
    query_start: torch.Tensor  # [B + 1]
    context_lens: torch.Tensor  # [B] after the step: also the position of each row's next sampled token
    state_in: torch.Tensor  # [B]
    state_out: torch.Tensor  # [B]
    fresh: torch.Tensor  # [B] 0/1
    sequence_index: torch.Tensor  # [B] the row's sequence index (block table and penalty rows)


@dataclass(frozen=True)
class PackedStep:
    """A step's facts as one int64 vector, on the host (`pack`) or on the device (`to_device`)."""

    values: torch.Tensor
    num_tokens: int
    num_rows: int
    query_start_host: tuple[int, ...]  # host copies of two fields, for the prefill ops' launch sizes
    context_lens_host: tuple[int, ...]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_rows

    @functools.cached_property
    def _fields(self) -> StepFields:
        n, b = self.num_tokens, self.num_rows
        return StepFields(*self.values.split([n, n, n, b + 1, b, b, b, b, b]))

    def fields(self) -> StepFields:
        """Views of `values`, made once (a decode graph's static input serves every replay)."""
        return self._fields


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
        write_spare: bool,
        ahead: int = 0,
    ) -> PackedStep:
        """Row r feeds ``inputs[r]`` at positions ``frontier..frontier+len-1`` of ``seqs[r]``.

        ``write_spare``: the final GDN state goes to the sequence's spare slot (provisional, flipped on
        commit); otherwise back into its current slot (a prefill chunk that commits directly).
        ``ahead``: a decode that many units past the committed one (`decode_values`).
        """
        if all(len(row) == 1 for row in inputs):
            tokens = [row[0] for row in inputs]
            values = self.decode_values(seqs, tokens, write_spare=write_spare, ahead=ahead)
            context_lens = [s.frontier + 1 + ahead for s in seqs]
            return _packed(values, len(seqs), range(len(seqs) + 1), context_lens)
        if ahead:
            raise ValueError("only a decode (one token per row) runs ahead of the committed frontier")
        ps = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        for seq, row in zip(seqs, inputs):
            start, end = seq.frontier, seq.frontier + len(row)
            tokens.extend(map(int, row))
            positions.extend(range(start, end))
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
            state_in=[s.slot for s in seqs],
            state_out=[s.spare if write_spare else s.slot for s in seqs],
            fresh=[int(s.frontier == 0) for s in seqs],  # start from zero GDN state
            sequence_index=[s.handle.index for s in seqs],
        )
        return _packed(values, len(tokens), query_start, context_lens)

    def decode_values(
        self, seqs: Sequence[SequenceState], tokens: Sequence[int], *, write_spare: bool, ahead: int = 0
    ) -> list[int]:
        """`pack`'s values for one token per row (``tokens[r]`` at position ``frontier`` of ``seqs[r]``) as a
        plain list: the decode round's short path (no per-page loop, no tensor).

        ``ahead=1``: the decode after the one not yet committed (the Program's lookahead), at position
        ``frontier + 1``, reading the state that unit writes and writing the ring's next slot."""
        ps = self.page_size
        positions = [s.frontier + ahead for s in seqs]
        if ahead:
            state_in, state_out = [s.slot_after(ahead - 1) for s in seqs], [s.slot_after(ahead) for s in seqs]
        else:
            state_in, state_out = [s.slot for s in seqs], [s.spare if write_spare else s.slot for s in seqs]
        return _layout(
            [int(t) for t in tokens],
            positions,
            [s.pages[p // ps] * ps + p % ps for s, p in zip(seqs, positions)],
            list(range(len(seqs) + 1)),
            context_lens=[p + 1 for p in positions],
            state_in=state_in,
            state_out=state_out,
            fresh=[int(p == 0) for p in positions],
            sequence_index=[s.handle.index for s in seqs],
        )

    @staticmethod
    def placeholder(num_rows: int, scratch_slot: int, device: torch.device) -> PackedStep:
        """A decode step for graph capture: every row reads and writes ``scratch_slot`` and KV slot 0 of
        page 0 (which no committed state depends on), context length 1, sequence index 0's table row."""
        b, zeros = num_rows, [0] * num_rows
        values = _layout(
            zeros,
            zeros,
            zeros,
            list(range(b + 1)),
            context_lens=[1] * b,
            state_in=[scratch_slot] * b,
            state_out=[scratch_slot] * b,
            fresh=zeros,
            sequence_index=zeros,
        )
        packed = _packed(values, b, range(b + 1), [1] * b)
        return dataclasses.replace(packed, values=packed.values.to(device))

    def to_device(self, packed: PackedStep) -> PackedStep:
        values = packed.values
        if self.device.type == "cuda":  # a copy from pageable memory would first drain the GPU queue
            values = values.pin_memory()
        return dataclasses.replace(packed, values=values.to(self.device, non_blocking=True))

    def unpack(self, packed: PackedStep, feed: torch.Tensor | None = None) -> StepBatch:
        """The `StepBatch` over ``packed`` (on the device): views and a few device ops, no host sync (with
        ``fused_unpack`` one Triton launch for the casts and the table gather, `step_unpack.unpack_step`).

        ``feed`` ([B] int64 on the device, a decode only): a row whose packed token id is negative takes
        ``feed[row]`` (a decode graph's tokens drawn by its previous replay, `graphs.DecodeGraphs`)."""
        f = packed.fields()
        token_ids = f.token_ids
        if self.fused_unpack:  # one launch in place of four small kernels per decode step
            from ninfer.ops.triton.step_unpack import unpack_step

            query_start, context_lens, block_table, fresh, fed = unpack_step(
                packed.values, packed.num_tokens, packed.num_rows, self.block_tables, feed
            )
            token_ids = token_ids if fed is None else fed
        else:
            query_start, context_lens = f.query_start.int(), f.context_lens.int()
            block_table = self.block_tables.index_select(0, f.sequence_index)
            fresh = f.fresh.bool()
            if feed is not None:
                if not packed.is_decode:
                    raise ValueError("only a decode (one token per row) takes fed tokens")
                token_ids = torch.where(token_ids < 0, feed, token_ids)
        return StepBatch(
            token_ids=token_ids,
            positions=f.positions.expand(3, -1),  # text: T = H = W
            query_start=query_start,
            context_lens=context_lens,
            block_table=block_table,
            slot_mapping=f.slot_mapping,
            state_in=f.state_in,
            state_out=f.state_out,
            fresh=fresh,
            query_start_host=packed.query_start_host,
            context_lens_host=packed.context_lens_host,
        )


def _packed(
    values: list[int], num_tokens: int, query_start: Sequence[int], context_lens: Sequence[int]
) -> PackedStep:
    """The host `PackedStep` over ``values`` (`_layout`), with host copies of two of its fields."""
    return PackedStep(
        torch.tensor(values, dtype=torch.long),
        num_tokens,
        len(context_lens),
        tuple(query_start),
        tuple(context_lens),
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
