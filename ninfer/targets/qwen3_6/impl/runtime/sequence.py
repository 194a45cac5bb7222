"""One active sequence's physical facts, private to the Program.

The committed frontier is the number of positions whose K/V and GDN state are in the store. The last
committed output token (``pending_input``) has been sampled but not yet run through the model: the
next unit feeds it at position ``frontier``.

GDN state lives in slots the sequence owns: ``current`` holds the committed state, the others are
spares. A unit reads ``current`` and writes spares (one per position it may have to keep, `spares`);
commit makes the slot of the accepted position current, abort keeps the old one. No state is copied.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ninfer.runtime.contract.types import LogprobParams, SamplingParams, SequenceHandle


@dataclass(eq=False)
class SequenceState:
    handle: SequenceHandle
    prompt: tuple[int, ...]
    max_total: int  # positions the request may reach (prompt + max_new_tokens)
    sampling: SamplingParams
    logprobs: LogprobParams
    slots: tuple[int, ...]  # the StateImage slots the sequence owns
    pages: list[int]  # KV pages mapped for the whole reservation, in position order
    current: int  # the slot holding the committed GDN state
    frontier: int = 0  # committed positions in KV and GDN state
    pending_input: int | None = None  # committed output token not yet run through the model
    state_valid: bool = True  # False after a partial accept of forced tokens: only release may follow
    rope_delta: int = 0  # M-RoPE: a text position p after the prompt is at rotary position p + delta
    # [3][len(prompt)] rotary positions of a prompt with images (None: position p is p + rope_delta)
    prompt_positions: Sequence[Sequence[int]] | None = None
    # images.PromptImages of a prompt with images (the tower's features, as the prefill needs them)
    images: Any = None
    media: tuple[tuple[int, int, str], ...] = ()  # the prompt's media spans (part of its prefix identity)
    generated: list[int] = field(default_factory=list)  # committed output tokens, in order

    def spares(self, count: int, exclude: Sequence[int] = ()) -> tuple[int, ...]:
        """The first ``count`` owned slots that are neither current nor in ``exclude`` (a queued unit's
        outputs), in a fixed order: where a unit writes its per-position states."""
        free = [s for s in self.slots if s != self.current and s not in exclude]
        if count > len(free):
            raise ValueError(f"{self.handle} holds {len(self.slots)} state slots; {count} spares wanted")
        return tuple(free[:count])

    @property
    def spare(self) -> int:
        """The slot a one-position unit writes into (it becomes current on commit)."""
        return self.spares(1)[0]

    @property
    def prompt_remaining(self) -> int:
        return len(self.prompt) - self.frontier if self.frontier < len(self.prompt) else 0

    @property
    def penalised(self) -> bool:
        """The sampler needs this sequence's prompt mask and output counts."""
        return self.sampling.penalised

    def rope_positions(self, start: int, end: int) -> tuple[list[int], list[int], list[int]]:
        """The T, H and W rotary positions of positions ``start..end-1``."""
        table = self.prompt_positions
        if table is None or start >= len(self.prompt):
            axis = list(range(start + self.rope_delta, end + self.rope_delta))
            return axis, axis, axis
        if end > len(self.prompt):
            raise ValueError(f"positions {start}..{end} cross the end of a {len(self.prompt)}-token prompt")
        return list(table[0][start:end]), list(table[1][start:end]), list(table[2][start:end])
