"""Turn a unit's rows (sequence + input tokens) into the model's `StepBatch` tensors.

Rows, slots and pages are plain data here: the same builder serves prefill chunks, decode rounds and
forced control. A step's host facts travel as one packed int64 vector (`pack`: token ids, positions, KV
slots, row bounds, context lengths, state slots, fresh flags, sequence indices) in one host-to-device
copy; `unpack` turns the device copy into the `StepBatch` views, gathering the rows' block tables from
the device-resident table (one row per sequence index, written at materialization). A captured decode
graph runs `unpack` inside the graph over its static packed buffer, so a decode step costs the host
one copy and one replay.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StepBatch


@dataclass(frozen=True)
class PackedStep:
    """A step's host facts: ``values`` (int64, host) laid out as `packed_length(num_tokens, num_rows)`."""

    values: torch.Tensor
    num_tokens: int
    num_rows: int
    query_start: tuple[int, ...]

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_rows


def packed_length(num_tokens: int, num_rows: int) -> int:
    """tokens, positions, slots (N each), query_start (B + 1), then five per-row fields (B each)."""
    return 3 * num_tokens + 6 * num_rows + 1


class StepBuilder:
    def __init__(self, page_size: int, block_tables: torch.Tensor) -> None:
        self.page_size = page_size
        self.block_tables = block_tables  # [max_sequences, max_pages] int32, on the device
        self.device = block_tables.device

    def pack(
        self, seqs: Sequence[SequenceState], inputs: Sequence[Sequence[int]], *, write_spare: bool
    ) -> PackedStep:
        """Row r feeds ``inputs[r]`` at positions ``frontier..frontier+len-1`` of ``seqs[r]``.

        ``write_spare``: the final GDN state goes to the sequence's spare slot (provisional, flipped on
        commit); otherwise back into its current slot (a prefill chunk that commits directly).
        """
        ps = self.page_size
        tokens: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        for seq, row in zip(seqs, inputs):
            for offset, token in enumerate(row):
                pos = seq.frontier + offset
                tokens.append(int(token))
                positions.append(pos)
                slot_mapping.append(seq.pages[pos // ps] * ps + pos % ps)
            query_start.append(len(tokens))
        values = torch.tensor(
            tokens
            + positions
            + slot_mapping
            + query_start
            + [s.frontier + len(row) for s, row in zip(seqs, inputs)]  # context lengths after the step
            + [s.slot for s in seqs]
            + [s.spare if write_spare else s.slot for s in seqs]
            + [int(s.frontier == 0) for s in seqs]  # fresh: start from zero GDN state
            + [s.handle.index for s in seqs],
            dtype=torch.long,
        )
        return PackedStep(values, len(tokens), len(seqs), tuple(query_start))

    def unpack(
        self, packed: torch.Tensor, num_tokens: int, num_rows: int, query_start: tuple[int, ...] | None
    ) -> StepBatch:
        """The `StepBatch` over ``packed`` (on the device): views and a few device ops, no host sync."""
        n, b = num_tokens, num_rows
        token_ids, pos, slots, qs, ctx, state_in, state_out, fresh, index = packed.split(
            [n, n, n, b + 1, b, b, b, b, b]
        )
        return StepBatch(
            token_ids=token_ids,
            positions=pos.expand(3, -1),  # text: T = H = W
            query_start=qs.int(),
            context_lens=ctx.int(),
            block_table=self.block_tables.index_select(0, index),
            slot_mapping=slots,
            state_in=state_in,
            state_out=state_out,
            fresh=fresh.bool(),
            query_start_host=query_start,
        )

    def build(
        self, seqs: Sequence[SequenceState], inputs: Sequence[Sequence[int]], *, write_spare: bool
    ) -> StepBatch:
        """`pack`, one copy to the device, `unpack`: the eager path's batch."""
        packed = self.pack(seqs, inputs, write_spare=write_spare)
        return self.to_device(packed)

    def to_device(self, packed: PackedStep) -> StepBatch:
        values = packed.values.to(self.device, non_blocking=True)
        return self.unpack(values, packed.num_tokens, packed.num_rows, packed.query_start)
