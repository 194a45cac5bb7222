"""The Engine's repeat hint to the Program (contract rule 13): ``decode(..., repeat_expected=True)`` only
when the next unit will be the same round (less the rows it ends by length) unless a row ends early or
asks for control: never while a prefill is staged, nor when a row ends by length while a request waits
for its lane (that request's prefill goes next).

A Program with the decode lookahead queues that round ahead on the hint; a hint before a prefill would
waste a whole decode step on the device, a missing one in steady decode would lose the overlap.
"""

from __future__ import annotations

from typing import Any

from engine_fixtures import drain, make_engine
from scripted_program import ScriptedProgram

from ninfer import GenerationRequest
from ninfer.runtime.engine.scheduler import Unit, UnitKind


def test_hint_is_false_before_a_prefill_and_true_in_steady_decode() -> None:
    program = ScriptedProgram(max_concurrency=2, max_context=128, page_size=4, kv_pages=128)
    engine, program, _ = make_engine(
        program=program, max_concurrency=2, queue_capacity=4, prefill_chunk_tokens=4
    )
    units: list[tuple[UnitKind, tuple[int, ...]]] = []

    def observe(_core: Any, unit: Unit) -> None:
        units.append((unit.kind, tuple(r.request_id for r in unit.members)))

    engine.core.observer = observe
    # three requests for two lanes: the third waits for a lane, and every prompt takes several chunks
    handles = [
        engine.submit(
            GenerationRequest(prompt="a" * (9 + 4 * i), max_tokens=12 + 3 * i, seed=i, ignore_eos=True)
        )
        for i in range(3)
    ]
    drain(engine)
    assert all(h.result().finish_reason == "length" for h in handles)

    decodes = [i for i, (kind, _) in enumerate(units) if kind is UnitKind.DECODE]
    assert len(program.repeat_hints) == len(decodes)
    hint_at = dict(zip(decodes, program.repeat_hints))
    before_prefill = [i for i in decodes if i + 1 < len(units) and units[i + 1][0] is UnitKind.PREFILL]
    assert len(before_prefill) >= 4, "the scenario interleaves prefill chunks with decode rounds"
    assert not any(hint_at[i] for i in before_prefill), [(i, units[i : i + 2]) for i in before_prefill]
    repeated = [i for i in decodes if i + 1 < len(units) and units[i + 1] == units[i]]
    assert len(repeated) >= 10 and all(hint_at[i] for i in repeated), [(i, hint_at[i]) for i in repeated]
