"""DFlash speculative decoding (``dflash:K``) through the public Engine, against plain decoding and
z-lab's reference drafter.

- Drafts are the reference's: every round's drafts of the tiny packages' random drafters equal those of
  `dflash.DFlashDraftModel` (the PyPI oracle) run from scratch over transformers' hidden states of the
  committed sequence, with chunked prefills, B = 1..8 rows and K up to 15: the drafter's context K/V,
  kept incrementally in the paged pool across prefill chunks, verifies and re-drafts, is what a cold
  recomputation gives. (z-lab's own generate loop is no oracle for Qwen3.6: its cache crop leaves the
  Gated DeltaNet state past rejected drafts, so it drifts from greedy decoding; docs/engine.md.)
- Greedy lossless: tokens and log-probs equal plain decoding's (random drafters reject almost
  everything; a drafter trained for the demo model by tools/train_demo/dflash.py accepts), rows ending
  inside a draft by a stop token, a stop string, max_tokens and a thinking budget's forced control.
- Reuse: DFlash with the context cache gives the tokens of DFlash without it and of plain decoding.
- Sampled lossless: the trained drafter's sampled tokens are distributed as plain sampling's
  (two-sample chi-square; the negative control is test_integration_mtp's wrong rule on the same verify).
- Start-up: an artifact without drafter weights refuses ``dflash:K`` naming why; K beyond the block is
  refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from cache_helpers import SYSTEM, build_engine
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
from tiny_artifacts import hf_causal_lm, reference_drafter, tiny_view  # the oracles and their weights

from ninfer import EngineConfig, GenerationResult
from ninfer.cli.common import bundled_artifact
from ninfer.runtime.engine.engine import Engine
from ninfer.targets.qwen3_6.impl.runtime.backends.dflash import DFlashDraft
from ninfer.targets.qwen3_6.impl.runtime.sequence import SequenceState
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.registry import PACKAGES

pytest.importorskip("dflash.model")  # the oracle (`tiny_artifacts.reference_drafter`)
torch.set_num_threads(1)

TINY = ("qwen3_6_tiny", "qwen3_6_tiny_moe")


# ---- the tiny packages' random drafters ----


class RecordingDraft(DFlashDraft):
    """Records every round's (prompt, frontier, drafts)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rounds: list[tuple[tuple[int, ...], int, list[int]]] = []

    def drafts(self, seq: SequenceState) -> list[int]:
        out = super().drafts(seq)
        self.rounds.append((tuple(seq.prompt), seq.frontier, out))
        return out


def tiny_engine(name: str, k: int | None, max_concurrency: int, **fields: object) -> Engine:
    view = tiny_view(name, drafter=True)
    backend = None if k is None else RecordingDraft(draft_tokens=k, dims=view.variant.dflash)
    return build_engine(
        name, view=view, max_concurrency=max_concurrency, prefix_cache=False, backend=backend, **fields
    )  # type: ignore[arg-type]


@functools.cache
def plain_alone(name: str) -> tuple[GenerationResult, ...]:
    with tiny_engine(name, None, 1) as engine:
        return tuple(engine.generate(r) for r in greedy_requests())


@functools.cache
def drafter_oracle(name: str) -> torch.nn.Module:
    return reference_drafter(tiny_view(name, drafter=True))


def reference_logits(name: str, sequence: list[int], frontier: int, k: int) -> torch.Tensor:
    """The reference drafter's logits [K, V] for the block at ``frontier`` of ``sequence``, from scratch:
    transformers' hidden states of the committed tokens, then one drafter forward."""
    view: ModelView = tiny_view(name, drafter=True)
    dims = view.variant.dflash
    assert dims is not None
    with torch.no_grad():
        hidden = hf_causal_lm(name)(
            torch.tensor([sequence[:frontier]]), output_hidden_states=True
        ).hidden_states
        taps = torch.cat([hidden[i + 1] for i in dims.target_layer_ids], dim=-1)
        block = torch.tensor([[sequence[frontier]] + [dims.mask_token_id] * k])
        noise = torch.nn.functional.embedding(block, view.text.embed)
        out = drafter_oracle(name)(
            target_hidden=taps, noise_embedding=noise, position_ids=torch.arange(frontier + k + 1)[None]
        )
        return out[0, 1:] @ view.text.lm_head.T


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize(("k", "mc"), [(1, 8), (4, 1), (15, 3)])
def test_drafts_equal_the_reference_and_output_is_plain(name: str, k: int, mc: int) -> None:
    with tiny_engine(name, k, mc) as engine:
        got = run_all(engine, greedy_requests())
        backend = engine.core.program.backend
    want = list(plain_alone(name))
    assert_same(got, want)
    assert isinstance(backend, RecordingDraft) and backend.rounds
    sequences = {tuple(r.prompt): list(r.prompt) + list(w.token_ids) for r, w in zip(greedy_requests(), want)}
    checked = 0
    for prompt, frontier, drafts in backend.rounds[:: max(1, len(backend.rounds) // 24)]:
        logits = reference_logits(name, sequences[prompt], frontier, k)
        for j, d in enumerate(drafts):  # each position is its own argmax of one forward
            best = int(logits[j].argmax())
            assert d == best or float(logits[j, best] - logits[j, d]) < 1e-4, (frontier, j, d, best)
        checked += 1
    assert checked >= 8


def test_a_k_beyond_the_block_and_a_missing_drafter_are_refused(tmp_path: Path) -> None:
    dims = PACKAGES["qwen3_6_tiny"].drafter
    assert dims is not None
    with pytest.raises(ValueError, match=r"dflash:K needs K = 1\.\.15"):
        DFlashDraft(draft_tokens=16, dims=dims)
    with pytest.raises(ValueError, match=r"draft tokens K must be 1\.\.15"):
        EngineConfig(speculative="dflash:16")
    config = EngineConfig(
        device="cpu", dtype="float32", speculative="dflash:4", warmup=False, max_context=256
    )
    with pytest.raises(ValueError, match="no DFlash drafter weights: convert it with --dflash DRAFTER_DIR"):
        Engine(bundled_artifact(), config)


# ---- the demo model with a trained drafter ----


@pytest.fixture(scope="module")
def demo_dflash(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ninfer_tools.train_demo.dflash import train, write_artifact

    view = train(steps=300, sequences=128, tokens=160, log=lambda line: None)
    return write_artifact(view, tmp_path_factory.mktemp("dflash") / "demo_dflash.ninfer", "fp32")


@pytest.mark.parametrize(("k", "mc"), [(7, 4), (15, 2), (3, 8)])
def test_the_trained_drafter_accepts_and_stays_lossless(demo_dflash: Path, k: int, mc: int) -> None:
    with demo_engine(demo_dflash, None, 8) as engine:
        want = run_all(engine, [demo_request(t, 40) for t in DEMO_TEXTS])
    with demo_engine(demo_dflash, f"dflash:{k}", mc) as engine:
        got = run_all(engine, [demo_request(t, 40) for t in DEMO_TEXTS])
        backend = engine.core.program.backend
    assert_same(got, want)
    assert isinstance(backend, DFlashDraft) and backend.accepted > 0
    for r in got:  # usage: each round kept a prefix of its drafts and the target's token
        rounds, kept = r.usage.draft_rounds, r.usage.accepted_draft_tokens
        assert r.usage.drafted_tokens == k * rounds and 0 <= kept <= r.usage.drafted_tokens
        assert rounds - 1 <= r.usage.completion_tokens - 1 - kept <= rounds


def test_rows_ending_inside_a_draft(demo_dflash: Path) -> None:
    with demo_engine(demo_dflash, None) as engine:
        plain = [engine.generate(demo_request(t, 40)) for t in DEMO_TEXTS]
    requests = ending_requests(plain)
    with demo_engine(demo_dflash, None) as engine:
        want = [engine.generate(r) for r in requests]
    for k in (4, 15):
        with demo_engine(demo_dflash, f"dflash:{k}", 4) as engine:
            got = run_all(engine, requests)
        assert_same(got, want)
    assert {r.finish_reason for r in want} >= {"stop", "length"}


def test_dflash_with_the_context_cache_gives_the_plain_tokens(demo_dflash: Path) -> None:
    """Turns that continue checkpoints (their drafter KV included) give the tokens of DFlash without
    the cache and of plain decoding."""

    def conversation(spec: str | None, cache: bool) -> list[tuple[int, ...]]:
        with demo_engine(demo_dflash, spec, 1, prefix_cache=cache, capture_interval=64) as engine:
            return coding_session(engine, SYSTEM, cache=cache)

    plain = conversation(None, False)
    assert conversation("dflash:7", True) == conversation("dflash:7", False) == plain


SAMPLED_RUNS = 160


def test_sampled_dflash_is_distributed_as_plain_sampling(demo_dflash: Path) -> None:
    with demo_engine(demo_dflash, None, 8) as engine:
        plain = sampled_tokens(engine, range(SAMPLED_RUNS))
    with demo_engine(demo_dflash, "dflash:3", 8) as engine:
        drafted = sampled_tokens(engine, range(SAMPLED_RUNS, 2 * SAMPLED_RUNS))
        again = sampled_tokens(engine, range(SAMPLED_RUNS, SAMPLED_RUNS + 8))
    assert again == drafted[:8]  # seeded rows repeat, whatever their batch
    for position in (1, 2, 3):
        p = homogeneity_p([t[position] for t in plain], [t[position] for t in drafted])
        assert p > 1e-3, (position, p)
