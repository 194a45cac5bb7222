"""One active sequence's physical facts, private to the Program.

The committed frontier is the number of positions whose K/V and GDN state are in the store. The last
committed output token (``pending_input``) has been sampled but not yet run through the model: the
next unit feeds it at position ``frontier``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ninfer.ops.sampling import SamplingParams as OpsSamplingParams
from ninfer.runtime.contract.types import LogprobParams, SequenceHandle


@dataclass(eq=False)
class SequenceState:
    handle: SequenceHandle
    prompt: tuple[int, ...]
    max_total: int  # complete growth reservation in positions (prompt + max_new_tokens)
    sampling: OpsSamplingParams
    seed: int
    logprobs: LogprobParams
    slots: tuple[int, ...]  # the sequence's StateImage slots, a ring (2, or 3 with decode lookahead)
    pages: list[int]  # KV pages mapped for the whole reservation, in position order
    frontier: int = 0  # committed positions in KV and GDN state
    pending_input: int | None = None  # committed output token not yet run through the model
    state_valid: bool = True  # False after a terminal partial accept: only release may follow
    committed: int = 0  # index into ``slots`` of the slot holding the committed GDN state

    @property
    def slot(self) -> int:
        """The slot holding the committed GDN state."""
        return self.slots[self.committed]

    @property
    def spare(self) -> int:
        """The slot the next unit writes into (it becomes the committed one on commit)."""
        return self.slots[(self.committed + 1) % len(self.slots)]

    def slot_after(self, units: int) -> int:
        """The slot a unit run ``units`` commits ahead writes into: a decode launched before the unit
        before it is committed (lookahead) writes the third slot of the ring, so the committed state
        stays intact whatever that commit decides."""
        if units + 2 > len(self.slots):
            raise ValueError(f"a ring of {len(self.slots)} slots holds no unit {units} commits ahead")
        return self.slots[(self.committed + 1 + units) % len(self.slots)]

    @property
    def prompt_remaining(self) -> int:
        return len(self.prompt) - self.frontier if self.frontier < len(self.prompt) else 0

    @property
    def penalised(self) -> bool:
        """The sampler needs this sequence's prompt mask and output counts."""
        return self.sampling.penalised

    def flip_slots(self) -> None:
        self.committed = (self.committed + 1) % len(self.slots)
