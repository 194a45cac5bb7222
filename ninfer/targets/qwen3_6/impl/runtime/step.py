"""Turn a unit's rows (sequence + input tokens) into the model's `StepBatch` tensors.

Rows, slots and pages are plain data here: the same builder serves prefill chunks, decode rounds and
forced control, and a captured decode graph reads these tensors from static buffers. The block tables
live on the device for the Program's life (one row per sequence index, written at materialization);
a step only gathers its rows. Everything else a step needs goes to the device in one packed copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StepBatch


class StepBuilder:
    def __init__(self, page_size: int, block_tables: torch.Tensor) -> None:
        self.page_size = page_size
        self.block_tables = block_tables  # [max_sequences, max_pages] int32, on the device
        self.device = block_tables.device

    def build(
        self, seqs: Sequence[SequenceState], inputs: Sequence[Sequence[int]], *, write_spare: bool
    ) -> StepBatch:
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
        n, b = len(tokens), len(seqs)
        packed = torch.tensor(
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
        ).to(self.device, non_blocking=True)
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
            query_start_host=tuple(query_start),
        )
