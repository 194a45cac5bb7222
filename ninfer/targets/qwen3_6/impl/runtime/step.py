"""Turn a unit's rows (sequence + input tokens) into the model's `StepBatch` tensors.

Rows, slots and pages are plain data here: the same builder serves prefill chunks, decode rounds and
forced control, and a captured decode graph reads these tensors from static buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StepBatch


class StepBuilder:
    def __init__(self, page_size: int, max_pages_per_seq: int, device: torch.device) -> None:
        self.page_size = page_size
        self.max_pages = max_pages_per_seq
        self.device = device

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
        context_lens: list[int] = []
        block_table: list[list[int]] = []
        for seq, row in zip(seqs, inputs):
            start = seq.frontier
            for offset, token in enumerate(row):
                pos = start + offset
                tokens.append(int(token))
                positions.append(pos)
                slot_mapping.append(seq.pages[pos // ps] * ps + pos % ps)
            query_start.append(len(tokens))
            context_lens.append(start + len(row))
            block_table.append(seq.pages + [0] * (self.max_pages - len(seq.pages)))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long)
        return StepBatch(
            token_ids=torch.tensor(tokens, dtype=torch.long, device=dev),
            positions=pos.expand(3, -1).contiguous().to(dev),  # text: T = H = W
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            block_table=torch.tensor(block_table, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=dev),
            state_in=torch.tensor([s.slot for s in seqs], dtype=torch.long, device=dev),
            state_out=torch.tensor(
                [s.spare if write_spare else s.slot for s in seqs], dtype=torch.long, device=dev
            ),
            fresh=torch.tensor([s.frontier == 0 for s in seqs], dtype=torch.bool, device=dev),
        )
