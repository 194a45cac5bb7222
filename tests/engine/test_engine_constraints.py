"""Structured outputs through the Engine, on the scripted Program and a byte-level choice grammar.

The Engine hands a constrained row's grammar to the Program with every unit, advances it by the tokens
the Program committed (only those, only after the commit), gives no repeat hint for rounds with a
constrained row (the decode lookahead), leaves unconstrained rounds exactly as before, ends only the
request whose grammar fails, and keeps every invariant under cancellation and concurrency.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest
from engine_fixtures import drain, make_engine
from scripted_frontend import EOS, OutputSession, ScriptedFrontend
from scripted_program import ScriptedProgram

from ninfer import GenerationRequest
from ninfer.runtime.contract.constraint import ConstraintInvalid, OutputConstraint
from ninfer.types import GenerationResult, RequestFailed, RequestRejected

WORDS = 8  # 256 byte tokens


def bitmask(allowed: set[int]) -> np.ndarray:
    words = np.zeros(WORDS, dtype=np.uint32)
    for t in allowed:
        words[t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


class ChoiceGrammar:
    """The output is one of ``choices`` (byte strings), then EOS. Logs every call."""

    def __init__(self, choices: Sequence[bytes], log: list[tuple[str, tuple[int, ...]]]) -> None:
        self.choices = [bytes(c) for c in choices]
        self.prefix = b""
        self.log = log
        self.fail_masks_at: int | None = None  # raise in masks() once the prefix has this many bytes
        self.fail_advance = False

    def _allowed(self, prefix: bytes) -> set[int]:
        allowed = {c[len(prefix)] for c in self.choices if c.startswith(prefix) and len(c) > len(prefix)}
        if prefix in self.choices:
            allowed.add(EOS)
        return allowed

    def masks(self, drafts: Sequence[int]) -> list[np.ndarray | None]:
        self.log.append(("masks", tuple(drafts)))
        if self.fail_masks_at is not None and len(self.prefix) >= self.fail_masks_at:
            raise RuntimeError("scripted grammar failure")
        out, prefix, dead = [], self.prefix, False
        for i in range(len(drafts) + 1):
            allowed = self._allowed(prefix)
            out.append(None if dead else bitmask(allowed))
            if i < len(drafts):
                d = drafts[i]
                if dead or d not in allowed or d == EOS:
                    dead = True
                else:
                    prefix += bytes([d])
        return out

    def advance(self, token_ids: Sequence[int], *, forced: bool = False) -> None:
        self.log.append(("advance", tuple(token_ids)))
        if self.fail_advance:
            raise RuntimeError("scripted advance failure")
        for t in token_ids:
            assert t in self._allowed(self.prefix), (self.prefix, t)
            if t != EOS:
                self.prefix += bytes([t])


class ConstrainedFrontend(ScriptedFrontend):
    """The scripted Frontend with ``choice`` constraints (others: not supported, left unset)."""

    def __init__(self) -> None:
        super().__init__()
        self.grammars: list[ChoiceGrammar] = []
        self.log: list[tuple[str, tuple[int, ...]]] = []

    def new_output_session(self, prompt, options) -> OutputSession:  # type: ignore[no-untyped-def]
        session = super().new_output_session(prompt, options)
        constraint = options.constraint
        if constraint is not None and constraint.kind == "choice":
            if any("!" in c for c in constraint.choices):
                raise ConstraintInvalid(f"{constraint.field_name}: '!' is not allowed in a choice here")
            grammar = ChoiceGrammar([c.encode() for c in constraint.choices], self.log)
            self.grammars.append(grammar)
            session.constraint = grammar  # type: ignore[attr-defined]
        return session


CHOICES = ("alpha", "beta", "gamma delta", "b")


def choice_request(seed: int, **kw: object) -> GenerationRequest:
    fields: dict[str, object] = dict(prompt="pick one: ", max_tokens=24, seed=seed, temperature=1.0)
    fields.update(kw)
    return GenerationRequest(constraint=OutputConstraint.choice(CHOICES, source="guided_choice"), **fields)


def result_of(handle) -> GenerationResult:  # type: ignore[no-untyped-def]
    events = list(handle)
    assert isinstance(events[-1], GenerationResult)
    return events[-1]


@pytest.mark.parametrize("spec_k", [1, 3])
def test_every_output_is_a_choice_and_the_matcher_moves_only_by_committed_tokens(spec_k: int) -> None:
    frontend = ConstrainedFrontend()
    program = ScriptedProgram(max_concurrency=8, eos_period=0, spec_k=spec_k)
    engine, program, _ = make_engine(program=program, frontend=frontend, max_concurrency=8)
    handles = [
        engine.submit(choice_request(seed, temperature=0.0 if seed % 2 else 1.0)) for seed in range(24)
    ]
    drain(engine)
    for handle, grammar in zip(handles, frontend.grammars):
        result = result_of(handle)
        assert result.finish_reason == "stop"
        assert result.text in CHOICES
        # the matcher saw committed tokens only, in order: every unit's but the one that ended the request
        assert result.text.encode().startswith(grammar.prefix)
        if spec_k == 1:
            assert grammar.prefix == result.text.encode()
    advanced = [t for kind, ts in frontend.log if kind == "advance" for t in ts]
    assert EOS not in advanced  # a terminal row's tokens are never fed: the request ends there
    assert all(program.constraint_rounds)
    assert program.usage() == engine.core.baseline


def test_constrained_rounds_get_no_repeat_hint_and_plain_rounds_are_unchanged() -> None:
    frontend = ConstrainedFrontend()
    program = ScriptedProgram(max_concurrency=4, eos_period=0)
    engine, program, _ = make_engine(program=program, frontend=frontend, max_concurrency=4)
    plain = engine.submit(GenerationRequest(prompt="xyz", max_tokens=12, seed=3))
    drain(engine)
    assert result_of(plain).finish_reason == "length"
    assert program.constraint_rounds and not any(program.constraint_rounds)
    assert any(program.repeat_hints)  # the lookahead hint as before
    hints_before = len(program.repeat_hints)
    mixed = [engine.submit(choice_request(1)), engine.submit(GenerationRequest(prompt="xyz", max_tokens=12))]
    drain(engine)
    assert all(result_of(h).finish_reason in ("stop", "length") for h in mixed)
    rounds = list(zip(program.constraint_rounds[hints_before:], program.repeat_hints[hints_before:]))
    assert any(c for c, _ in rounds)
    assert not any(hint for constrained, hint in rounds if constrained)


def test_bad_constraint_is_refused_at_submit_naming_its_field() -> None:
    engine, _, _ = make_engine(frontend=ConstrainedFrontend())
    with pytest.raises(RequestRejected) as bad:
        engine.submit(
            GenerationRequest(prompt="x", constraint=OutputConstraint.choice(["ok!"], source="guided_choice"))
        )
    assert bad.value.kind == "invalid_request" and bad.value.message.startswith("guided_choice:")
    with pytest.raises(RequestRejected) as unsupported:  # this Frontend only does choices
        engine.submit(
            GenerationRequest(prompt="x", constraint=OutputConstraint.regex("a+", source="guided_regex"))
        )
    assert unsupported.value.message.startswith("guided_regex:")
    with pytest.raises(RequestRejected) as shape:
        engine.submit(GenerationRequest(prompt="x", constraint=OutputConstraint.choice([])))
    assert "choice needs at least one" in shape.value.message
    with pytest.raises(RequestRejected) as eos:
        engine.submit(choice_request(1, ignore_eos=True))
    assert "ignore_eos" in eos.value.message
    with pytest.raises(RequestRejected) as tools:
        engine.submit(
            GenerationRequest(prompt="x", constraint=OutputConstraint.tool_call(source="tool_choice"))
        )
    assert tools.value.message.startswith("tool_choice:")
    assert engine.core.outstanding == 0


@pytest.mark.parametrize("where", ["masks", "advance"])
def test_a_failing_grammar_ends_only_its_request(where: str) -> None:
    frontend = ConstrainedFrontend()
    engine, program, _ = make_engine(
        frontend=frontend, program=ScriptedProgram(eos_period=0), max_concurrency=4
    )
    failing = engine.submit(choice_request(1, temperature=0.0))
    grammar = frontend.grammars[-1]
    if where == "masks":
        grammar.fail_masks_at = 2
    else:
        grammar.fail_advance = True
    others = [engine.submit(choice_request(seed)) for seed in range(2, 5)]
    plain = engine.submit(GenerationRequest(prompt="abc", max_tokens=8, seed=9))
    drain(engine)
    bad = result_of(failing)
    assert bad.finish_reason == "error" and isinstance(bad.error, RequestFailed)
    assert "constraint" in bad.error.message
    assert all(result_of(h).text in CHOICES for h in others)
    assert result_of(plain).finish_reason == "length"
    assert not engine.core.failed
    assert program.usage() == engine.core.baseline


def test_constraints_with_cancellation_and_concurrency_keep_the_engine_healthy() -> None:
    rng = random.Random(5)
    frontend = ConstrainedFrontend()
    program = ScriptedProgram(max_concurrency=8, eos_period=0, spec_k=2)
    engine, program, _ = make_engine(program=program, frontend=frontend, max_concurrency=8, queue_capacity=64)
    live = []
    for step in range(400):
        if rng.random() < 0.3 and len(live) < 40:
            constrained = rng.random() < 0.6
            request = (
                choice_request(rng.randrange(1 << 30), temperature=rng.choice([0.0, 1.0]))
                if constrained
                else GenerationRequest(prompt="zz", max_tokens=rng.randint(1, 10), seed=step)
            )
            live.append((constrained, engine.submit(request)))
        if live and rng.random() < 0.1:
            live[rng.randrange(len(live))][1].cancel()
        engine.core.step()
    drain(engine)
    for constrained, handle in live:
        result = result_of(handle)
        assert result.finish_reason in ("stop", "length", "cancelled")
        if constrained and result.finish_reason == "stop":
            assert result.text in CHOICES
        if constrained and result.finish_reason == "cancelled":
            assert any(c.startswith(result.text) for c in CHOICES)  # a prefix of a choice, never more
    assert not engine.core.failed
    assert program.usage() == engine.core.baseline
    assert engine.core.outstanding == 0
