"""Shared pieces of the HTTP gateway tests: scripted Programs behind the real Qwen3.6 Frontend, and an
in-process server (uvicorn on a thread, 127.0.0.1, a free port)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))  # the Engine tests' scripted Program

from scripted_program import ScriptedProgram, ScriptedScoringProgram  # noqa: E402

from ninfer import Engine, EngineConfig  # noqa: E402
from ninfer.runtime.engine.engine import Engine as EngineType  # noqa: E402
from ninfer.serve import BackgroundServer, ServeConfig, create_app  # noqa: E402
from ninfer.targets.qwen3_6.frontend import Frontend  # noqa: E402

MODEL = "tiny"
__all__ = [
    "MODEL",
    "ScriptProgram",
    "ScriptedProgram",
    "ScriptedScoringProgram",
    "metric",
    "running_server",
    "scripted_engine",
    "wait_until",
]


class ScriptProgram(ScriptedProgram):
    """A ScriptedProgram whose every request produces ``script`` (then ``eos`` forever), so a test can
    make the model say exactly the official tool-call XML. ``unit_sleep_s`` slows each execution unit
    down like a real model, so requests overlap in time."""

    def __init__(
        self, script: Sequence[int] = (), eos: int = 0, unit_sleep_s: float = 0.0, **kwargs: object
    ) -> None:
        super().__init__(eos_period=0, **kwargs)  # type: ignore[arg-type]
        self.script = tuple(script)
        self.eos = eos
        self.unit_sleep_s = unit_sleep_s
        self.unit_log: list[tuple[str, float]] = []  # (kind, monotonic start) of every execution unit
        self.release_log: list[float] = []
        self.on_execute = self._on_execute
        self.on_release = lambda seq: self.release_log.append(time.monotonic())

    def _on_execute(self, kind: str, handles: object) -> None:
        self.unit_log.append((kind, time.monotonic()))
        if self.unit_sleep_s:
            time.sleep(self.unit_sleep_s)

    def _sample(self, seq, start: int, previous: int, n: int) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
        if not self.script:
            return super()._sample(seq, start, previous, n)
        k = start - len(seq.plan.prompt_token_ids)  # output index of the first token to produce
        return tuple(self.script[k + i] if k + i < len(self.script) else self.eos for i in range(n))


def scripted_engine(program: ScriptedProgram, frontend: Frontend, **config: object) -> EngineType:
    settings: dict[str, object] = {"max_concurrency": program.max_concurrency, "warmup": False}
    settings.update(config)
    return Engine.from_parts(program, frontend, EngineConfig(**settings))  # type: ignore[arg-type]


@contextlib.contextmanager
def running_server(
    engine: EngineType | Callable[[], EngineType],
    frontend: Frontend,
    *,
    api_key: str | None = None,
    wait_ready: bool = True,
) -> Iterator[BackgroundServer]:
    """The app on a uvicorn thread; closes the Engine when the block ends."""
    app = create_app(engine, ServeConfig(model_name=MODEL, api_key=api_key), frontend=frontend)
    server = BackgroundServer(app)
    server.start()
    try:
        if wait_ready:
            wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, 120)
        yield server
    finally:
        server.stop()


def wait_until(condition: Callable[[], bool], timeout: float, interval: float = 0.01) -> float:
    """Poll until ``condition()``; returns the seconds it took. Raises TimeoutError."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def metric(base_url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of the server's /metrics (0 if the labelled series does not exist yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url + "/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in (labels or {}).items()):
                return float(sample.value)
    return 0.0
