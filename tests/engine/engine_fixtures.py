"""Small builders shared by the Engine tests (step-driven engines on the scripted Program/Frontend)."""

from __future__ import annotations

from typing import Any

from scripted_frontend import ScriptedFrontend
from scripted_program import ScriptedProgram

from ninfer import Engine, EngineConfig
from ninfer.types import GenerationEvent


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_engine(
    *,
    program: ScriptedProgram | None = None,
    frontend: ScriptedFrontend | None = None,
    clock: FakeClock | None = None,
    start_worker: bool = False,
    **config: Any,
) -> tuple[Engine, ScriptedProgram, ScriptedFrontend]:
    """A generation Engine on a ScriptedProgram; config keys go to EngineConfig."""
    program = program or ScriptedProgram(max_concurrency=config.get("max_concurrency", 4))
    frontend = frontend or ScriptedFrontend()
    config.setdefault("warmup", False)
    config.setdefault("page_size", program.page_size)
    engine = Engine.from_parts(
        program, frontend, EngineConfig(**config), clock=clock, start_worker=start_worker
    )
    return engine, program, frontend


def drain(engine: Engine, limit: int = 10_000) -> int:
    """Step the worker until no request is left; returns the number of boundaries."""
    n = 0
    while not engine.core.idle:
        engine.core.step()
        n += 1
        assert n < limit, "engine did not drain"
    return n


def events_of(handle: Any) -> list[GenerationEvent]:
    return list(handle)
