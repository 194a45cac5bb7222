"""The general step and the accepted-prefix commit, on the tiny dense and MoE packages in fp32.

- A step of T tokens for each of B rows (one verify step, the state after every position kept in its own
  slot) equals T one-token steps chained through the same slots: logits (so tokens and log-probs), the
  GDN conv and recurrent state after every position, and the K/V it writes. B = 1..8, T = 2..8.
- Commits of accepted prefixes of every length, mixed across rows, through the known-continuation
  backend (drafts: plain decoding's tokens, corrupted where the test wants the first rejection), leave
  each sequence exactly where a replay of just the accepted tokens leaves it (state and K/V), give
  plain decoding's tokens and log-probs, and end with every pool at its baseline.
"""

from __future__ import annotations

import functools

import pytest
import torch
from test_program_direct import commit_all, prompts
from tiny_artifacts import tiny_view

from ninfer.runtime.contract.types import (
    LogprobParams,
    PendingBatch,
    RequestPlan,
    ResourcePlan,
    RowDecision,
    SamplingParams,
    SequenceHandle,
)
from ninfer.targets.qwen3_6.impl.runtime.backends.known import KnownContinuation
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.model import StateStore
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)

PACKAGE_NAMES = ["qwen3_6_tiny", "qwen3_6_tiny_moe"]
PAGE = 16
CLOSE = {"rtol": 2e-5, "atol": 2e-5}


def program_for(name: str, backend: object | None = None, max_concurrency: int = 8) -> Qwen36Program:
    variant = PACKAGES[name].variant
    config = ProgramConfig(
        max_concurrency=max_concurrency, max_context=160, page_size=PAGE, kv_pages=12 * max_concurrency,
        device=torch.device("cpu"), dtype=torch.float32,
    )  # fmt: skip
    return Qwen36Program(variant, tiny_view(name), config, backend=backend)  # type: ignore[arg-type]


def materialize(
    program: Qwen36Program, prompt: list[int], max_new: int, **sampling: object
) -> SequenceHandle:
    params = SamplingParams(seed=int(sampling.pop("seed", 7)), **sampling)  # type: ignore[arg-type]
    logprobs = LogprobParams(enabled=True, top_n=2)
    plan = program.plan_materialization(RequestPlan(tuple(prompt), max_new, params, logprobs, "d"))
    assert isinstance(plan, ResourcePlan), plan
    return program.finish(program.start(plan)).handle


def prefill(program: Qwen36Program, handle: SequenceHandle) -> int:
    while not isinstance(pending := program.prefill(handle, 9), PendingBatch):
        pass
    return commit_all(program, pending)[0]


def clone(store: StateStore) -> StateStore:
    return StateStore(store.conv.clone(), store.rec.clone(), store.k_pages.clone(), store.v_pages.clone())


def many_prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [
        torch.randint(0, 248320, (int(length),), generator=g).tolist()
        for length in torch.randint(3, 30, (n,), generator=g)
    ]


@functools.cache
def prefilled(name: str) -> tuple[Qwen36Program, tuple[SequenceState, ...]]:
    """Eight sequences past their prompts (frontiers from 3 to 29 positions, mid-page and across pages),
    on a Program whose sequences hold 9 state slots (a known-continuation backend of 8 drafts)."""
    backend = KnownContinuation(draft_tokens=8, continuation=lambda seq: ())
    program = program_for(name, backend)
    handles = [materialize(program, p, 40, temperature=0.0) for p in many_prompts(8)]
    for h in handles:
        prefill(program, h)
    return program, tuple(program._sequences[h.index] for h in handles)


def kv_of(store: StateStore, seq: SequenceState, positions: range) -> tuple[torch.Tensor, torch.Tensor]:
    slots = torch.tensor([seq.pages[p // PAGE] * PAGE + p % PAGE for p in positions])
    k = store.k_pages.flatten(1, 2)[:, slots]
    v = store.v_pages.flatten(1, 2)[:, slots]
    return k, v


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("tokens", range(2, 9))
@pytest.mark.parametrize("rows", range(1, 9))
def test_t_token_step_equals_t_single_token_steps(name: str, tokens: int, rows: int) -> None:
    program, all_seqs = prefilled(name)
    seqs = all_seqs[:rows]
    executor, store = program.executor, program.store
    gen = torch.Generator().manual_seed(100 * rows + tokens)
    inputs = torch.randint(0, 248320, (rows, tokens), generator=gen).tolist()
    outs = [s.spares(tokens) for s in seqs]
    before = clone(store)

    with torch.inference_mode():
        one = executor.uniform(
            seqs,
            [x for row in inputs for x in row],
            tokens,
            state_in=[s.current for s in seqs],
            state_out=outs,
        )
        t_step = clone(store)
        logits_t = one.logits.view(rows, tokens, -1).clone()
        store.conv.copy_(before.conv), store.rec.copy_(before.rec)
        store.k_pages.copy_(before.k_pages), store.v_pages.copy_(before.v_pages)
        singles = []
        for t in range(tokens):
            state_in = [s.current if t == 0 else o[t - 1] for s, o in zip(seqs, outs)]
            run = executor.uniform(
                seqs,
                [row[t] for row in inputs],
                1,
                state_in=state_in,
                state_out=[o[t] for o in outs],
                offset=t,
            )
            singles.append(run.logits.clone())
    logits_1 = torch.stack(singles, dim=1)

    torch.testing.assert_close(logits_t, logits_1, **CLOSE)
    assert torch.equal(logits_t.argmax(-1), logits_1.argmax(-1))
    torch.testing.assert_close(logits_t.log_softmax(-1), logits_1.log_softmax(-1), **CLOSE)
    for s, o in zip(seqs, outs):  # the state after every position, in its own slot
        for t in range(tokens):
            torch.testing.assert_close(t_step.conv[:, o[t]], store.conv[:, o[t]], **CLOSE)
            torch.testing.assert_close(t_step.rec[:, o[t]], store.rec[:, o[t]], **CLOSE)
        written = range(s.frontier, s.frontier + tokens)
        for got, want in zip(kv_of(t_step, s, written), kv_of(store, s, written)):
            torch.testing.assert_close(got, want, **CLOSE)
        committed = range(0, s.frontier)  # untouched
        for got, want in zip(kv_of(t_step, s, committed), kv_of(before, s, committed)):
            assert torch.equal(got, want)
        assert torch.equal(t_step.rec[:, s.current], before.rec[:, s.current])  # the committed slot


def plain_decoding(name: str, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from a plain Program."""
    program = program_for(name, max_concurrency=1)
    h = materialize(program, prompt, n + 1, temperature=0.0)
    while not isinstance(pending := program.prefill(h, 9), PendingBatch):
        pass
    tokens, logprobs = [], []
    for _ in range(n):
        row = pending.rows[0]
        tokens.append(row.tokens[0])
        logprobs.append(row.logprobs[0].logprob)
        commit_all(program, pending)
        pending = program.decode([h], [n])
    program.abort_pending(pending)
    program.release(h)
    return tokens, logprobs


def replay_state(name: str, prompt: list[int], accepted: list[int]) -> tuple[StateStore, SequenceState]:
    """A plain Program that prefilled ``prompt`` and then ran exactly ``accepted`` tokens, one by one."""
    program = program_for(name, max_concurrency=1)
    h = materialize(program, prompt, len(accepted) + 2, temperature=0.0)
    while not isinstance(pending := program.prefill(h, 9), PendingBatch):
        pass
    program.commit(pending, [RowDecision(h, 1)])
    seq = program._sequences[h.index]
    for token in accepted[:-1]:  # the last accepted token is the pending input: not yet run
        seq.pending_input = token
        pending = program.decode([h], [2])
        program.commit(pending, [RowDecision(h, 1)])
    seq.pending_input = accepted[-1]
    return program.store, seq


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("draft_tokens", [1, 3, 5])
def test_accepted_prefix_commits_equal_a_replay_of_the_accepted_tokens(name: str, draft_tokens: int) -> None:
    n_out = 14
    ps = prompts(4)
    expected = {tuple(p): plain_decoding(name, p, n_out + draft_tokens + 1) for p in ps}
    # where each row's drafts go wrong: every rejection point 0..K, differently per row and round
    schedule = [[(r + j) % (draft_tokens + 1) for j in range(20)] for r in range(len(ps))]
    rounds: dict[int, int] = {}

    def continuation(seq: SequenceState) -> list[int]:
        tokens = list(expected[seq.prompt][0])
        row = ps.index(list(seq.prompt))
        k = rounds.get(row, 0)
        wrong_at = schedule[row][k % 20]
        generated = seq.frontier + 1 - len(seq.prompt)
        if generated + wrong_at < len(tokens):
            tokens[generated + wrong_at] = (tokens[generated + wrong_at] + 1) % 248320
        return tokens

    backend = KnownContinuation(draft_tokens=draft_tokens, continuation=continuation)
    program = program_for(name, backend, max_concurrency=4)
    baseline = program.usage()
    handles = [materialize(program, p, n_out, temperature=0.0) for p in ps]
    out: dict[int, list[int]] = {i: [prefill(program, h)] for i, h in enumerate(handles)}
    seen_logprobs: dict[int, list[float]] = {i: [] for i in range(len(ps))}
    live = list(range(len(ps)))
    while live:
        budgets = [n_out - len(out[i]) for i in live]
        pending = program.decode([handles[i] for i in live], budgets)
        decisions = []
        for i, row in zip(live, pending.rows):
            k = rounds.get(i, 0)
            wrong_at = schedule[i][k % 20]
            assert row.produced == min(wrong_at + 1, n_out - len(out[i])), (i, k, row.produced)
            rounds[i] = k + 1
            out[i] += row.tokens
            seen_logprobs[i] += [lp.logprob for lp in row.logprobs]
            decisions.append(RowDecision(row.handle, row.produced, terminal=len(out[i]) >= n_out))
        program.commit(pending, decisions)
        for i in list(live):
            seq = program._sequences[handles[i].index]
            store, replayed = replay_state(name, ps[i], out[i])
            assert seq.frontier == replayed.frontier and seq.pending_input == replayed.pending_input
            torch.testing.assert_close(
                program.store.rec[:, seq.current], store.rec[:, replayed.current], **CLOSE
            )
            torch.testing.assert_close(
                program.store.conv[:, seq.current], store.conv[:, replayed.current], **CLOSE
            )
            positions = range(seq.frontier)
            for got, want in zip(kv_of(program.store, seq, positions), kv_of(store, replayed, positions)):
                torch.testing.assert_close(got, want, **CLOSE)
            if len(out[i]) >= n_out:
                program.release(handles[i])
                live.remove(i)
    for i, p in enumerate(ps):
        tokens, logprobs = expected[tuple(p)]
        assert out[i] == tokens[:n_out], i
        torch.testing.assert_close(torch.tensor(seen_logprobs[i]), torch.tensor(logprobs[1:n_out]), **CLOSE)
    assert program.usage() == baseline


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_terminal_partial_accept_keeps_the_state_of_the_accepted_prefix(name: str) -> None:
    """A row that ends inside its verified tokens (a stop string, say) accepts a prefix of them; its state
    is then that of the prefix (what a retained checkpoint would need), not marked unusable."""
    p = prompts(1)[0]
    tokens, _ = plain_decoding(name, p, 10)
    backend = KnownContinuation(draft_tokens=4, continuation=lambda seq: tokens)
    program = program_for(name, backend, max_concurrency=1)
    h = materialize(program, p, 10, temperature=0.0)
    first = prefill(program, h)
    pending = program.decode([h], [9])
    assert pending.rows[0].tokens == tuple(tokens[1:6])  # every draft accepted, plus the bonus
    program.commit(pending, [RowDecision(h, 2, terminal=True)])
    seq = program._sequences[h.index]
    store, replayed = replay_state(name, p, [first, *tokens[1:3]])
    assert seq.state_valid and seq.frontier == replayed.frontier and seq.pending_input == tokens[2]
    torch.testing.assert_close(program.store.rec[:, seq.current], store.rec[:, replayed.current], **CLOSE)
    program.release(h)
