"""MTP speculative decoding (``mtp:K``) through the public Engine, against plain decoding.

- Greedy lossless: the tiny dense and MoE packages (random MTP heads: almost every draft rejected) and
  the demo model (a trained head: many accepted), K = 1..4, B = 1..8 with rows joining and leaving:
  tokens equal plain decoding's and log-probs agree within 1e-4; rows that end by a stop token, a stop
  string or max_tokens inside a draft, and a thinking budget's forced control.
- Reuse: MTP with the context cache gives the tokens of MTP without it and of plain decoding.
- Sampled lossless: the distribution of the tokens after the first under MTP equals plain sampling's
  (two-sample chi-square over seeded runs); a deliberately wrong acceptance rule fails the same test.
  Seeded runs repeat exactly and do not depend on the batch.
"""

from __future__ import annotations

import functools

import pytest
import torch
from cache_helpers import SYSTEM, build_engine, tiny_view
from integration_helpers import (
    DEMO_TEXTS,
    assert_same,
    coding_session,
    demo_engine,
    demo_request,
    ending_requests,
    greedy_requests,
    homogeneity_p,
    run_all,
    sampled_tokens,
)

from ninfer import EngineConfig, GenerationResult
from ninfer.cli.common import bundled_artifact
from ninfer.runtime.engine.engine import Engine
from ninfer.targets.qwen3_6.impl.runtime.backends.mtp import MtpDraft
from ninfer.targets.qwen3_6.impl.runtime.program import Qwen36Program

torch.set_num_threads(1)


def mtp_demo(spec: str | None, max_concurrency: int = 1, **fields: object) -> Engine:
    """`demo_engine` on the bundled demo artifact (its MTP head)."""
    return demo_engine(bundled_artifact(), spec, max_concurrency, **fields)


def tiny_engine(name: str, k: int | None, max_concurrency: int, **fields: object) -> Engine:
    engine = build_engine(
        name, view=tiny_view(name), max_concurrency=max_concurrency, prefix_cache=False, **fields
    )  # type: ignore[arg-type]
    if k is None:
        return engine
    old = engine.core.program
    assert isinstance(old, Qwen36Program)
    engine.close()
    program = Qwen36Program(old.variant, old.view, old.config, backend=MtpDraft(draft_tokens=k, layers=1))
    return Engine.from_parts(program, engine.frontend, engine.config, package_name=name)


@functools.cache
def _plain_alone(name: str) -> tuple[GenerationResult, ...]:
    with tiny_engine(name, None, 1) as engine:
        return tuple(engine.generate(r) for r in greedy_requests())


@pytest.mark.parametrize("name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
@pytest.mark.parametrize(("k", "mc"), [(1, 8), (2, 3), (3, 1), (4, 5)])
def test_random_heads_are_lossless(name: str, k: int, mc: int) -> None:
    """Random MTP weights reject nearly every draft: the output is plain decoding's all the same, with
    rows of different lengths joining and leaving the rounds."""
    with tiny_engine(name, k, mc) as engine:
        got = run_all(engine, greedy_requests())
        backend = engine.core.program.backend
    assert_same(got, list(_plain_alone(name)))
    assert isinstance(backend, MtpDraft) and backend.drafted > 0


@functools.cache
def _demo_plain(max_tokens: int) -> tuple[GenerationResult, ...]:
    with mtp_demo(None) as engine:
        return tuple(engine.generate(demo_request(t, max_tokens)) for t in DEMO_TEXTS)


@pytest.mark.parametrize(("k", "mc"), [(1, 1), (2, 8), (3, 4), (4, 2)])
def test_the_demo_head_accepts_and_stays_lossless(k: int, mc: int) -> None:
    with mtp_demo(f"mtp:{k}", mc) as engine:
        got = run_all(engine, [demo_request(t, 40) for t in DEMO_TEXTS])
        backend = engine.core.program.backend
    assert_same(got, list(_demo_plain(40)))
    assert isinstance(backend, MtpDraft)
    assert backend.accepted > 0.25 * backend.drafted / k  # the trained head's drafts are often right
    for r in got:  # usage: each round kept its accepted drafts and the target's token (the last may be cut)
        rounds, kept = r.usage.draft_rounds, r.usage.accepted_draft_tokens
        assert r.usage.drafted_tokens == k * rounds and 0 <= kept <= r.usage.drafted_tokens
        assert rounds - 1 <= r.usage.completion_tokens - 1 - kept <= rounds
        by_position = r.usage.accepted_by_position  # a round keeps a prefix of its drafts
        assert sum(by_position) == kept and len(by_position) <= k
        assert all(a >= b for a, b in zip((rounds, *by_position), by_position))
    assert sum(r.usage.accepted_draft_tokens for r in got) > 0
    assert all(r.usage.drafted_tokens == 0 for r in _demo_plain(40))


@pytest.mark.parametrize("draft_vocab", [1, 300, 2048])
def test_a_shortlist_draft_head_stays_lossless(draft_vocab: int) -> None:
    """``draft_vocab``: the draft head scores only the first ids (a single one: every draft is token 0);
    the verify scores them all, so the tokens are plain decoding's whatever the shortlist, and a draft
    is never outside it."""
    proposed: list[int] = []
    with mtp_demo("mtp:3", 4, draft_vocab=draft_vocab) as engine:
        backend = engine.core.program.backend
        assert isinstance(backend, MtpDraft)
        drafts = backend.drafts
        backend.drafts = lambda seq: proposed.extend(d := drafts(seq)) or d  # type: ignore[method-assign]
        got = run_all(engine, [demo_request(t, 40) for t in DEMO_TEXTS])
    assert_same(got, list(_demo_plain(40)))
    assert proposed and max(proposed) < draft_vocab
    if draft_vocab == 2048:  # most of the demo text's tokens are among its first 2,048 ids
        assert backend.accepted > 0.25 * backend.drafted / 3


def test_draft_vocab_needs_mtp() -> None:
    with pytest.raises(ValueError, match="draft_vocab needs speculative 'mtp:K'"):
        EngineConfig(draft_vocab=1024)
    with pytest.raises(ValueError, match="draft_vocab must be >= 1"):
        EngineConfig(speculative="mtp:2", draft_vocab=0)


def test_rows_ending_inside_a_draft() -> None:
    """A stop token, a stop string and max_tokens that fall inside an accepted draft end the row where
    plain decoding ends it; so does the budget's forced control of a thinking chat."""
    plain = _demo_plain(40)
    requests = ending_requests(plain)
    with mtp_demo(None) as engine:
        want = [engine.generate(r) for r in requests]
    for k in (2, 4):
        with mtp_demo(f"mtp:{k}", 4) as engine:
            got = run_all(engine, requests)
        assert_same(got, want)
    assert {r.finish_reason for r in want} >= {"stop", "length"}


def test_mtp_with_the_context_cache_gives_the_plain_tokens() -> None:
    """A conversation whose turns continue checkpoints (their MTP KV included) decodes with MTP to the
    tokens of MTP without the cache and of plain decoding."""

    def conversation(spec: str | None, cache: bool) -> list[tuple[int, ...]]:
        with mtp_demo(spec, 1, prefix_cache=cache, capture_interval=64) as engine:
            return coding_session(engine, SYSTEM, cache=cache)

    plain = conversation(None, False)
    assert conversation("mtp:3", True) == conversation("mtp:3", False) == plain


# ---- sampled ----


SAMPLED_RUNS = 160


class _AcceptEverything(MtpDraft):
    """The negative control: keeps every draft, whatever the target says."""

    def accept(self, seq: object, accepted: int) -> int:  # type: ignore[override]
        return self.draft_tokens


def _demo_with(backend: MtpDraft, max_concurrency: int) -> Engine:
    engine = mtp_demo(f"mtp:{backend.draft_tokens}", max_concurrency)  # the MTP weights loaded
    old = engine.core.program
    assert isinstance(old, Qwen36Program)
    engine.close()
    program = Qwen36Program(old.variant, old.view, old.config, backend=backend)
    return Engine.from_parts(program, engine.frontend, engine.config)


@functools.cache
def _plain_sampled() -> tuple[tuple[int, ...], ...]:
    with mtp_demo(None, 8) as engine:
        return tuple(sampled_tokens(engine, range(SAMPLED_RUNS)))


def test_sampled_mtp_is_distributed_as_plain_sampling() -> None:
    plain = _plain_sampled()
    with mtp_demo("mtp:2", 8) as engine:
        mtp = sampled_tokens(engine, range(SAMPLED_RUNS, 2 * SAMPLED_RUNS))
        accepted = engine.core.program.backend.accepted  # type: ignore[attr-defined]
    assert accepted > 0
    for position in (1, 2, 3):  # the first token comes from the prefill, the same path for both
        p = homogeneity_p([t[position] for t in plain], [t[position] for t in mtp])
        assert p > 1e-3, (position, p)


def test_a_wrong_acceptance_rule_fails_the_same_test() -> None:
    plain = _plain_sampled()
    with _demo_with(_AcceptEverything(draft_tokens=2, layers=1), 8) as engine:
        wrong = sampled_tokens(engine, range(SAMPLED_RUNS, 2 * SAMPLED_RUNS))
    worst = min(homogeneity_p([t[j] for t in plain], [t[j] for t in wrong]) for j in (1, 2, 3))
    assert worst < 1e-6, worst


def test_seeded_sampling_repeats_and_ignores_the_batch() -> None:
    seeds = range(7, 15)
    with mtp_demo("mtp:3", 1) as engine:
        alone = [sampled_tokens(engine, range(s, s + 1))[0] for s in seeds]
    with mtp_demo("mtp:3", 8) as engine:
        together = sampled_tokens(engine, seeds)
        again = sampled_tokens(engine, seeds)
    assert alone == together == again
