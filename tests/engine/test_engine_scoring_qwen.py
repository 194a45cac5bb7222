"""The Qwen3.6 scoring Program's top-n alternatives and next-token prediction equal transformers' top-k
and argmax, across lm_head row-chunk boundaries (chunks shrunk to 4 rows so a 13-token window has a chunk
holding only the next-token row); a greedy token's logprob equals its top-1 value exactly. On CUDA
(float32), the same top-n ids and values as on CPU, and the same exact-equality rule."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from tiny_artifacts import hf_causal_lm

from ninfer import Engine, EngineConfig, ScoreResult
from ninfer.targets.qwen3_6.impl.runtime import scoring as qwen_scoring

torch.set_num_threads(1)

IDS = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 11, 323, 1221, 432]  # 13 tokens
TOP_N = 3
ATOL = 2e-4


@functools.cache
def oracle_log_softmax(ids: tuple[int, ...]) -> torch.Tensor:
    """``[len(ids), vocab]`` log-softmax from transformers: row i predicts token i + 1."""
    with torch.no_grad():
        logits = hf_causal_lm("qwen3_6_tiny")(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _config(device: str) -> EngineConfig:
    window = {"score_window": 16, "score_stride": 8}
    return EngineConfig(purpose="causal_scoring", device=device, dtype="float32", warmup=False, **window)


def _score(artifact: Path, device: str, **kwargs: object) -> ScoreResult:
    with Engine(artifact, _config(device)) as engine:
        return engine.score([IDS], **kwargs)[0]  # type: ignore[arg-type]


def _assert_top_equal(got: tuple[tuple[int, float], ...], row: torch.Tensor, atol: float) -> None:
    values, ids = row.topk(len(got))
    assert [t for t, _ in got] == ids.tolist()
    assert [v for _, v in got] == pytest.approx(values.tolist(), abs=atol)


def _assert_greedy_rule(result: ScoreResult) -> None:
    """Where the token is the most likely one, its logprob and the top-1 value are the same float."""
    for t in range(1, len(IDS)):
        top = result.top_logprobs[t]
        assert top is not None and all(a[1] >= b[1] for a, b in zip(top, top[1:]))
        if top[0][0] == IDS[t]:
            assert result.logprobs[t] == top[0][1]


@pytest.mark.parametrize("chunk_rows", [4, 256])
def test_alternatives_and_next_token_equal_transformers(
    tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch, chunk_rows: int
) -> None:
    monkeypatch.setattr(qwen_scoring, "_LOGPROB_ROWS", chunk_rows)
    result = _score(tiny_artifact, "cpu", top_n=TOP_N, next_token=True)
    rows = oracle_log_softmax(tuple(IDS))
    assert result.logprobs[0] is None and result.top_logprobs[0] is None
    for t in range(1, len(IDS)):
        assert result.logprobs[t] == pytest.approx(float(rows[t - 1, IDS[t]]), abs=ATOL)
        _assert_top_equal(result.top_logprobs[t], rows[t - 1], ATOL)  # type: ignore[arg-type]
    nxt = result.next_token
    assert nxt is not None and nxt.token_id == int(rows[-1].argmax())
    assert nxt.logprob == pytest.approx(float(rows[-1].max()), abs=ATOL)
    assert nxt.top[0] == (nxt.token_id, nxt.logprob) and len(nxt.top) == TOP_N
    _assert_top_equal(nxt.top, rows[-1], ATOL)
    _assert_greedy_rule(result)
    # the plain call computes the same logprobs and nothing else
    plain = _score(tiny_artifact, "cpu")
    assert plain.logprobs == result.logprobs and plain.top_logprobs == () and plain.next_token is None


def test_next_token_only_and_one_token_text(tiny_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(qwen_scoring, "_LOGPROB_ROWS", 4)
    with Engine(tiny_artifact, _config("cpu")) as engine:
        whole, single = engine.score([IDS, IDS[:1]], next_token=True)  # top_n 0: the greedy token alone
    assert whole.next_token is not None and whole.next_token.top == ()
    assert whole.next_token.token_id == int(oracle_log_softmax(tuple(IDS))[-1].argmax())
    row = oracle_log_softmax(tuple(IDS[:1]))[0]
    assert single.logprobs == (None,) and single.next_token is not None
    assert single.next_token.token_id == int(row.argmax())
    assert single.next_token.logprob == pytest.approx(float(row.max()), abs=ATOL)


@pytest.mark.gpu
def test_cuda_alternatives_match_cpu(tiny_artifact: Path) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cpu = _score(tiny_artifact, "cpu", top_n=5, next_token=True)
    cuda = _score(tiny_artifact, "cuda", top_n=5, next_token=True)
    assert cuda.logprobs[1:] == pytest.approx(cpu.logprobs[1:], abs=1e-3)
    for t in range(1, len(IDS)):
        got, want = cuda.top_logprobs[t], cpu.top_logprobs[t]
        assert got is not None and want is not None
        assert [i for i, _ in got] == [i for i, _ in want]
        assert [v for _, v in got] == pytest.approx([v for _, v in want], abs=1e-3)
    assert cuda.next_token is not None and cpu.next_token is not None
    assert cuda.next_token.token_id == cpu.next_token.token_id
    _assert_greedy_rule(cuda)
