"""`KnownContinuation`: a speculative test and benchmark backend whose drafts are given.

Each decode unit proposes, for every row, the next K tokens of a continuation known in advance (a
function of the sequence: e.g. plain decoding's output for its prompt, or any tokens at all) through
the shared verify round (`verify.VerifyRound`), so its output is plain decoding's whatever the drafts
are; only the accepted length depends on them.

``acceptance`` (benchmarks only): a function ``(sequence, accepted) -> accepted'`` that overrides how
many drafts a row accepts, so that the verify and commit path runs at a chosen mean accepted length
with weights that accept nothing; its output is then not the target's (labelled as such wherever it is
reported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ninfer.runtime.contract.types import SequenceHandle
from ninfer.targets.qwen3_6.impl.runtime.backends.verify import VerifyRound
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState

# the known continuation of a sequence: its output tokens after the prompt, as far as they are known
Continuation = Callable[[SequenceState], Sequence[int]]
Acceptance = Callable[[SequenceState, int], int]


def scripted_acceptance(mean_accepted: float) -> Acceptance:
    """Accept drafts so that each row produces ``mean_accepted`` tokens per verify on average (accepted
    drafts + 1), spread evenly over its verifies, whatever the verify rule said."""
    rate = mean_accepted - 1.0
    steps: dict[SequenceHandle, int] = {}

    def accept(seq: SequenceState, _accepted: int) -> int:
        t = steps.get(seq.handle, 0)
        steps[seq.handle] = t + 1
        if len(steps) > 64:  # released sequences: keep the table small
            steps.clear()
            steps[seq.handle] = t + 1
        return int((t + 1) * rate) - int(t * rate)

    return accept


class KnownContinuation(VerifyRound):
    name = "known"

    def __init__(
        self, *, draft_tokens: int, continuation: Continuation, acceptance: Acceptance | None = None
    ) -> None:
        super().__init__(draft_tokens=draft_tokens)
        self.continuation = continuation
        self.acceptance = acceptance

    def drafts(self, seq: SequenceState) -> list[int]:
        """The K tokens after the sequence's last committed one (zeros past the known continuation)."""
        known = self.continuation(seq)
        generated = seq.frontier + 1 - len(seq.prompt)  # outputs committed so far, pending_input included
        drafts = [int(t) for t in known[generated : generated + self.draft_tokens]]
        return drafts + [0] * (self.draft_tokens - len(drafts))

    def accept(self, seq: SequenceState, accepted: int) -> int:
        return accepted if self.acceptance is None else self.acceptance(seq, accepted)
