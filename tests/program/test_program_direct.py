"""The family Program driven directly through the contract: greedy tokens equal transformers' generate,
rows batched together equal rows alone, abort_pending leaves state untouched, accounting returns to 0."""

from __future__ import annotations

import functools

import pytest
import torch
from tiny_artifacts import SEED, hf_causal_lm, tiny_view

from ninfer.runtime.contract.types import (
    LogprobParams,
    PendingBatch,
    ProgramInvariantError,
    RequestPlan,
    ResourcePlan,
    RowDecision,
    SamplingParams,
)
from ninfer.targets.qwen3_6.binder import random_model_view
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)


def view(name: str):
    return tiny_view(name)


@functools.cache
def hf_generate(name: str, prompt: tuple[int, ...], n: int) -> list[int]:
    with torch.no_grad():
        out = hf_causal_lm(name).generate(
            torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def make_program(
    name: str, max_concurrency: int = 4, decode_lookahead: bool = False, device: str = "cpu"
) -> Qwen36Program:
    """The tiny package's Program: fp32 on CPU; on CUDA as the Engine builds it there (bf16, the fast
    kernels, a decode graph per B)."""
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    variant = PACKAGES[name].variant
    return Qwen36Program(
        variant,
        random_model_view(variant, seed=SEED, dtype=dtype, device=device) if cuda else view(name),
        ProgramConfig(
            max_concurrency=max_concurrency,
            max_context=128,
            page_size=16,
            kv_pages=8 * max_concurrency,
            device=torch.device(device),
            dtype=dtype,
            cuda_graphs=cuda,
            decode_lookahead=decode_lookahead,
        ),
    )


def materialize(program: Qwen36Program, prompt: list[int], max_new: int, temperature: float = 0.0):
    plan = program.plan_materialization(
        RequestPlan(
            tuple(prompt), max_new, SamplingParams(seed=1, temperature=temperature), LogprobParams(), "d"
        )
    )
    assert isinstance(plan, ResourcePlan), plan
    return program.finish(program.start(plan)).handle


def commit_all(program: Qwen36Program, pending: PendingBatch) -> list[int]:
    program.commit(pending, [RowDecision(r.handle, r.produced) for r in pending.rows])
    return [r.tokens[0] for r in pending.rows]


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 248320, (int(L),), generator=g).tolist() for L in (5, 23, 40, 17)[:n]]


@pytest.mark.parametrize("name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_batched_greedy_equals_transformers(name: str) -> None:
    program = make_program(name)
    baseline = program.usage()
    ps = prompts(4)
    handles = [materialize(program, p, 8) for p in ps]
    out: dict[int, list[int]] = {i: [] for i in range(4)}
    for i, h in enumerate(handles):  # chunked prefill (budget 9) then the first token
        while not isinstance(pending := program.prefill(h, 9), PendingBatch):
            pass
        out[i] += commit_all(program, pending)
    for _ in range(7):  # decode rounds of all four rows at once
        tokens = commit_all(program, program.decode(handles, [8] * 4))
        for i, t in enumerate(tokens):
            out[i].append(t)
    for i, p in enumerate(ps):
        assert out[i] == hf_generate(name, tuple(p), 8), f"row {i}"
    for h in handles:
        program.release(h)
    assert program.usage() == baseline


def test_abort_pending_leaves_state_and_contract_checks() -> None:
    program = make_program("qwen3_6_tiny", 2)
    p = prompts(1)[0]
    h = materialize(program, p, 6)
    first = commit_all(program, program.prefill(h, 64))
    pending = program.decode([h], [5])
    with pytest.raises(ProgramInvariantError):
        program.decode([h], [5])  # unconsumed batch
    with pytest.raises(ProgramInvariantError):
        program.commit(pending, [RowDecision(h, 0)])  # an illegal disposition: the batch stays open
    program.abort_pending(pending)
    with pytest.raises(ProgramInvariantError):
        program.commit(pending, [RowDecision(h, 1)])  # consumed twice
    second = commit_all(program, program.decode([h], [5]))
    assert first + second == hf_generate("qwen3_6_tiny", tuple(p), 8)[:2]
    program.release(h)
    with pytest.raises(ProgramInvariantError):
        program.decode([h], [1])  # stale handle


def test_forced_tokens_then_decode_equals_model_on_that_text() -> None:
    program = make_program("qwen3_6_tiny", 1)
    p = prompts(1)[0]
    h = materialize(program, p, 10)
    first = commit_all(program, program.prefill(h, 64))
    forced = [11, 22, 33]
    pending = program.force(h, forced)
    program.commit(pending, [RowDecision(h, 3)])
    nxt = commit_all(program, program.decode([h], [6]))
    # the same continuation as greedy decoding of the prompt + first + forced tokens
    assert nxt == hf_generate("qwen3_6_tiny", tuple(p + first + forced), 1)
    program.release(h)


def test_forced_tokens_carry_the_models_logprobs() -> None:
    program = make_program("qwen3_6_tiny", 1)
    p = prompts(1)[0]
    plan = program.plan_materialization(
        RequestPlan(tuple(p), 6, SamplingParams(seed=1, temperature=0.0), LogprobParams(True, 3), "d")
    )
    h = program.finish(program.start(plan)).handle
    first = commit_all(program, program.prefill(h, 64))
    forced = [11, 22, 33]
    pending = program.force(h, forced)
    row = pending.rows[0]
    with torch.no_grad():
        logits = hf_causal_lm("qwen3_6_tiny")(input_ids=torch.tensor([p + first + forced])).logits[0].float()
    expected = torch.log_softmax(logits, dim=-1)[len(p) : len(p) + 3]  # predictions of the forced tokens
    assert row.logprobs is not None and [lp.token_id for lp in row.logprobs] == forced
    for i, lp in enumerate(row.logprobs):
        assert abs(lp.logprob - expected[i, forced[i]].item()) < 1e-4
        assert [t for t, _ in lp.top] == expected[i].topk(3).indices.tolist()
    program.commit(pending, [RowDecision(h, 3)])
    program.release(h)


def test_decode_calls_while_running_once_and_a_raising_callback_opens_nothing() -> None:
    """Contract rule 12 on the real Program: the callback runs once per decode, inside the call; if it
    raises, decode raises it with no PendingBatch open and nothing committed, so the same decode runs
    again from the same frontier with the same token."""
    program = make_program("qwen3_6_tiny", max_concurrency=2)
    handle = materialize(program, prompts(1)[0], 8)
    first = program.prefill(handle, 64)
    assert isinstance(first, PendingBatch)
    commit_all(program, first)

    calls: list[int] = []
    # the callback itself must not call the Program (rule 12): it only looks at the private field
    pending = program.decode([handle], [4], while_running=lambda: calls.append(program._open_pending is None))
    assert calls == [True], "called once, before decode opened its PendingBatch"
    frontier = pending.rows[0].base_frontier
    expected = pending.rows[0].tokens
    program.abort_pending(pending)

    class CallbackFailed(RuntimeError):
        pass

    def fail() -> None:
        raise CallbackFailed("engine-side bug")

    with pytest.raises(CallbackFailed):
        program.decode([handle], [4], while_running=fail)
    assert program.usage().open_pending_batches == 0
    again = program.decode([handle], [4])
    assert again.rows[0].base_frontier == frontier and again.rows[0].tokens == expected
    commit_all(program, again)


def _with_graph_argmax(program: Qwen36Program, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Give every one-token-per-row step the argmax a decode graph computes (CPU has no graphs), and
    count the sampler's calls."""
    from ninfer.targets.qwen3_6.impl.runtime import draws

    run, sample, calls = program.executor.uniform, draws.sample, []

    def run_with_argmax(seqs: list, tokens: list, tokens_per_row: int, **kwargs: object) -> object:
        out = run(seqs, tokens, tokens_per_row, **kwargs)
        return out._replace(greedy=out.logits.argmax(dim=-1)) if tokens_per_row == 1 else out

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(1)
        return sample(*args, **kwargs)

    monkeypatch.setattr(program.executor, "uniform", run_with_argmax)
    monkeypatch.setattr(draws, "sample", counted)
    return calls


def test_greedy_rows_take_the_graphs_argmax_and_others_the_sampler(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows that all decode greedily without penalties or log-probs take their tokens from the step's
    argmax (no sampler call) and still give transformers' tokens; a sampled row, a penalised greedy row or
    a row wanting log-probs in the unit runs the sampler for every row, with the tokens and log-probs of a
    Program without the argmax."""
    ps = prompts(2)

    def run(argmax: bool, temperature: float, logprobs: LogprobParams, penalty: float) -> tuple[object, int]:
        program = make_program("qwen3_6_tiny", 2)
        calls = _with_graph_argmax(program, monkeypatch) if argmax else []
        handles = []
        for i, p in enumerate(ps):  # row 1 carries the sampled / penalised setting
            sampling = SamplingParams(seed=5 + i, temperature=temperature * i, repetition_penalty=penalty**i)
            plan = program.plan_materialization(RequestPlan(tuple(p), 6, sampling, logprobs, "d"))
            assert isinstance(plan, ResourcePlan), plan
            handles.append(program.finish(program.start(plan)).handle)
        out = [commit_all(program, program.prefill(h, 64)) for h in handles]
        prefill_calls, seen_logprobs = len(calls), []
        for _ in range(5):
            pending = program.decode(handles, [5, 5])
            seen_logprobs.append([row.logprobs for row in pending.rows])
            for i, t in enumerate(commit_all(program, pending)):
                out[i].append(t)
        monkeypatch.undo()
        return (out, seen_logprobs), len(calls) - prefill_calls

    (greedy, _), sampler_calls = run(True, 0.0, LogprobParams(), 1.0)
    assert sampler_calls == 0
    assert greedy == [hf_generate("qwen3_6_tiny", tuple(p), 6) for p in ps]
    for temperature, logprobs, penalty in (
        (0.9, LogprobParams(), 1.0),
        (0.0, LogprobParams(enabled=True, top_n=2), 1.0),
        (0.0, LogprobParams(), 1.3),
    ):
        mixed, sampler_calls = run(True, temperature, logprobs, penalty)
        assert sampler_calls == 5, (temperature, logprobs, penalty)
        assert mixed == run(False, temperature, logprobs, penalty)[0]
