"""`KnownContinuation`: a speculative test and benchmark backend whose drafts are given.

Each decode unit proposes, for every row, the next K tokens of a continuation known in advance (a
function of the sequence: e.g. plain decoding's output for its prompt, or any tokens at all), runs them
through the real verify step (B rows x K + 1 tokens, one CUDA graph per (B, K + 1)) and accepts a prefix
by the exact rule of `ninfer.ops.speculative` (greedy: while the draft equals the target's argmax;
sampled: with probability p(draft)), so its output is plain decoding's whatever the drafts are; only the
accepted length depends on them. The commit of ``a`` accepted tokens makes the slot of the state after
position ``a - 1`` current: no re-execution, no state copy.

``acceptance`` (benchmarks only): a function ``(sequence, accepted) -> accepted'`` that overrides how
many drafts a row accepts, so that the verify and commit path runs at a chosen mean accepted length
with weights that accept nothing; its output is then not the target's (labelled as such wherever it is
reported).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ninfer.runtime.contract.types import PendingRow, RowDecision, SequenceHandle, TokenLogprob
from ninfer.targets.qwen3_6.impl.runtime.backends import RowCommit
from ninfer.targets.qwen3_6.impl.runtime.draws import Sampler
from ninfer.targets.qwen3_6.impl.runtime.executor import StepExecutor
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


class KnownContinuation:
    name = "known"

    def __init__(
        self, *, draft_tokens: int, continuation: Continuation, acceptance: Acceptance | None = None
    ) -> None:
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        self.draft_tokens = draft_tokens
        self.continuation = continuation
        self.acceptance = acceptance
        self.drafted = 0  # drafts proposed and accepted by the verify rule (observability; tests read it)
        self.accepted = 0
        self._executor: StepExecutor | None = None
        self._sampler: Sampler | None = None

    def bind(self, executor: StepExecutor, sampler: Sampler) -> None:
        self._executor, self._sampler = executor, sampler

    @property
    def tokens_per_step(self) -> int:
        return self.draft_tokens + 1

    @property
    def slots_per_sequence(self) -> int:
        """Current + the state after each of a verify's positions."""
        return 1 + self.tokens_per_step

    @property
    def extra_tokens(self) -> int:
        """A verify near the end of a reservation still writes K drafts past the last allowed token."""
        return self.draft_tokens

    def graph_shapes(self, max_batch: int) -> list[tuple[int, int]]:
        rows = range(1, max_batch + 1)
        return [(b, 1) for b in rows] + [(b, self.tokens_per_step) for b in rows]

    def drafts(self, seq: SequenceState) -> list[int]:
        """The K tokens after the sequence's last committed one (zeros past the known continuation)."""
        known = self.continuation(seq)
        generated = seq.frontier + 1 - len(seq.prompt)  # outputs committed so far, pending_input included
        drafts = [int(t) for t in known[generated : generated + self.draft_tokens]]
        return drafts + [0] * (self.draft_tokens - len(drafts))

    def decode(
        self,
        seqs: Sequence[SequenceState],
        budgets: Sequence[int],
        *,
        while_running: Callable[[], None] | None,
        repeat_expected: bool,
    ) -> list[PendingRow]:
        executor, sampler = self._executor, self._sampler
        assert executor is not None and sampler is not None, "KnownContinuation.bind was not called"
        t = self.tokens_per_step
        drafts = [self.drafts(s) for s in seqs]
        outs = [s.spares(t) for s in seqs]
        tokens = [x for s, d in zip(seqs, drafts) for x in (s.pending_input, *d)]
        run = executor.uniform(seqs, tokens, t, state_in=[s.current for s in seqs], state_out=outs)
        queued = sampler.verify(seqs, run, drafts)
        if while_running is not None:
            while_running()
        chosen, accepted, logprob, top_ids, top_lp = queued.read()
        rows = []
        for i, (s, budget) in enumerate(zip(seqs, budgets)):
            a = accepted[i]
            self.drafted += self.draft_tokens
            self.accepted += a
            if self.acceptance is not None:
                a = max(0, min(self.draft_tokens, self.acceptance(s, a)))
                produced = (*drafts[i][:a], chosen[i][a])
            else:
                produced = tuple(chosen[i][: a + 1])
            produced = produced[:budget]
            lp = None
            if s.logprobs.enabled:
                n = s.logprobs.top_n
                lp = tuple(
                    TokenLogprob(
                        tok, logprob[i][j], tuple(zip(top_ids[i][j][:n], top_lp[i][j][:n])) if n else ()
                    )
                    for j, tok in enumerate(produced)
                )
            rows.append(PendingRow(s.handle, produced, s.frontier, lp, RowCommit(outs[i])))
        return rows

    def committed(
        self, seqs: Sequence[SequenceState], rows: Sequence[PendingRow], decisions: Sequence[RowDecision]
    ) -> None:
        pass

    def drop(self, handle: SequenceHandle | None = None) -> None:
        pass  # nothing is queued past a unit
