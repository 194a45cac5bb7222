"""The causal_scoring purpose on the real family Program equals transformers' log-softmax.

A text that fits one window gets the full-context values; a longer text gets, per token, the value
transformers computes over the window that scored it. The window rule is re-derived here from its
documentation (docs/engine.md, ninfer/runtime/scoring/core.py), not imported: windows start at
multiples of the stride while they end before the last token, the last window is aligned to the end of
the text, and each token takes its value from the earliest-starting window that holds it with at least
one token before it. Also `ninfer score ARTIFACT - --json` in a subprocess.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from integration_helpers import PACKAGE_NAMES, artifact_for, fixture_tokenizer_ids, hf_logprobs

from ninfer import Engine, EngineConfig, GenerationRequest, RequestRejected, ScoreResult

torch.set_num_threads(1)
WINDOW, STRIDE = 24, 10
TOL = 1e-4
SHORT_TEXT = "The quick brown fox jumps over the lazy dog."
LONG_TEXT = (
    "Paged attention keeps the key and value cache in fixed-size pages. A block table maps each "
    "sequence's logical positions to physical pages, so memory is allocated in small pieces and "
    "sequences of very different lengths share one pool without fragmentation. Recurrent layers keep "
    "a constant-size state instead."
)


def window_start(t: int, n: int, window: int, stride: int) -> int:
    """Start of the window that scores token ``t >= 1`` of an ``n``-token text: the earliest of the
    stride multiples whose window ends before the last token and the end-aligned ``n - window``
    that holds ``t`` with context before it."""
    starts = [s for s in range(0, n, stride) if s + window < n] + [max(0, n - window)]
    return min(s for s in starts if s < t < s + window)


@pytest.fixture(scope="module", params=PACKAGE_NAMES)
def scored(request: pytest.FixtureRequest) -> tuple[str, ScoreResult, ScoreResult]:
    name = request.param
    config = EngineConfig(
        purpose="causal_scoring", device="cpu", dtype="float32", score_window=WINDOW, score_stride=STRIDE
    )
    with Engine(artifact_for(request, name), config) as engine:
        short, long = engine.score([SHORT_TEXT, LONG_TEXT])
        with pytest.raises(RequestRejected, match="purpose='generation'"):  # the purpose is fixed
            engine.submit(GenerationRequest(prompt="hi"))
    return name, short, long


def test_text_is_scored_raw(scored: tuple[str, ScoreResult, ScoreResult]) -> None:
    _, short, long = scored
    assert list(short.token_ids) == fixture_tokenizer_ids(SHORT_TEXT)
    assert list(long.token_ids) == fixture_tokenizer_ids(LONG_TEXT)
    assert 2 < len(short.token_ids) <= WINDOW < 2 * WINDOW < len(long.token_ids)


def test_one_window_equals_full_context_logprobs(scored: tuple[str, ScoreResult, ScoreResult]) -> None:
    name, short, _ = scored
    expected = hf_logprobs(name, short.token_ids)
    assert short.logprobs[0] is None
    for t, (got, want) in enumerate(zip(short.logprobs[1:], expected), start=1):
        assert got is not None and abs(got - want) <= TOL, (t, got, want)
    assert math.isclose(short.total_nll, -math.fsum(expected), rel_tol=1e-6)


def test_long_text_takes_each_value_from_its_window(scored: tuple[str, ScoreResult, ScoreResult]) -> None:
    name, _, long = scored
    ids = long.token_ids
    n = len(ids)
    by_start: dict[int, list[float]] = {}
    for t in range(1, n):
        s = window_start(t, n, WINDOW, STRIDE)
        assert s + WINDOW <= n  # every window is a full one: the tail is not scored from a short window
        if s not in by_start:  # transformers over exactly that window (positions restart at 0)
            by_start[s] = hf_logprobs(name, ids[s : s + WINDOW])
        want = by_start[s][t - s - 1]
        got = long.logprobs[t]
        assert got is not None and abs(got - want) <= TOL, (t, s, got, want)
    assert long.logprobs[0] is None
    assert n - WINDOW in by_start and (n - WINDOW) % STRIDE  # the end-aligned window is off the stride grid
    assert math.isclose(long.total_nll, -math.fsum(long.logprobs[1:]), rel_tol=1e-9)  # type: ignore[arg-type]
    # the windows matter: beyond the first window the full-context values are different numbers
    full = hf_logprobs(name, ids)
    assert max(abs(long.logprobs[t] - full[t - 1]) for t in range(WINDOW, n)) > 1e-3  # type: ignore[operator]


def test_cli_score_json_from_stdin(tiny_artifact: object) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ninfer", "score", str(tiny_artifact), "-", "--json", "--device", "cpu"],
        input=SHORT_TEXT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert {"token_ids", "logprobs", "total_nll"} <= out.keys()
    assert out["token_ids"] == fixture_tokenizer_ids(SHORT_TEXT)
    logprobs = out["logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(out["token_ids"])
    assert all(isinstance(lp, float) for lp in logprobs[1:])
    assert math.isclose(out["total_nll"], -math.fsum(logprobs[1:]), rel_tol=1e-12)
    expected = hf_logprobs("qwen3_6_tiny", out["token_ids"])  # the default 2048 window holds it all
    assert max(abs(a - b) for a, b in zip(logprobs[1:], expected)) <= TOL
