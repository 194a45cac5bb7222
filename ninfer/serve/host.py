"""EngineHost: the gateway's hold on one Engine and its Frontend, including loading in the background.

The server answers ``/health`` at once while the Engine loads (weights, warmup) on a thread; ``/ready``
maps the Engine's own ``availability`` (the gateway never decides readiness itself) and reports
``loading`` before the Engine object exists or ``failed`` if construction raised.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio.to_thread

from ninfer.artifact.errors import ArtifactError
from ninfer.runtime.engine.engine import Engine
from ninfer.serve.errors import ServeError
from ninfer.types import Availability, NInferError

log = logging.getLogger("ninfer.serve")

EngineSource = Engine | Callable[[], Engine]


class ServeFrontend(Protocol):
    """What the gateway needs from a family Frontend (the Qwen3.6 ``Frontend`` provides it)."""

    eos_token_ids: tuple[int, ...]
    generation_defaults: dict[str, Any]

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def min_tokens(self, n_bytes: int) -> int: ...

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def prepare_tokens(self, ids: Sequence[int]) -> Any: ...

    def prepare_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> Any: ...


@dataclass(frozen=True)
class HostStatus:
    state: str  # loading | starting | warming | ready | failed | closed
    reason: str | None = None

    @property
    def ready(self) -> bool:
        return self.state == "ready"


class EngineHost:
    """Owns the Engine for the server's lifetime: ``start()`` loads it, ``close()`` closes it."""

    def __init__(self, source: EngineSource, frontend: ServeFrontend, *, retry_after_s: int = 1) -> None:
        self.frontend = frontend
        self.retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._engine: Engine | None = source if isinstance(source, Engine) else None
        self._loader: Callable[[], Engine] | None = None if isinstance(source, Engine) else source
        self._load_error: str | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- lifecycle ----
    def start(self) -> None:
        """Begin loading (on a thread) if the Engine is not built yet."""
        if self._loader is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._load, name="ninfer-serve-loader", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        assert self._loader is not None
        try:
            engine = self._loader()
        except (ArtifactError, ValueError, NInferError) as exc:  # a bad artifact or setting: one line
            log.error("loading the Engine failed: %s", " ".join(str(exc).split()))
            with self._lock:
                self._load_error = f"{type(exc).__name__}: {exc}"
            return
        except Exception as exc:  # noqa: BLE001 - any loading failure is reported through /ready
            log.exception("loading the Engine failed")
            with self._lock:
                self._load_error = f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            if not self._closed:
                self._engine = engine
                return
        engine.close()  # the server shut down while the Engine was loading

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self) -> None:
        """Close the Engine; blocks while its worker drains (up to ``Engine.close``'s timeout)."""
        with self._lock:
            self._closed = True
            engine = self._engine
        if engine is not None:
            engine.close()

    async def aclose(self) -> None:
        """``close()`` on a worker thread: joining the Engine's worker must not stall the event loop,
        which still serves the connections that are finishing during shutdown."""
        await anyio.to_thread.run_sync(self.close)

    # ---- state ----
    def status(self) -> HostStatus:
        with self._lock:
            engine, error = self._engine, self._load_error
        if error is not None:
            return HostStatus("failed", f"loading the model failed: {error}")
        if engine is None:
            return HostStatus("loading", "the model is loading")
        availability: Availability = engine.availability
        return HostStatus(availability.state, availability.reason)

    @property
    def loaded(self) -> Engine | None:
        with self._lock:
            return self._engine

    def engine(self) -> Engine:
        """The Engine, or a 503 that says why there is none to serve with."""
        status = self.status()
        engine = self.loaded
        if engine is not None and status.state in ("ready", "warming", "starting"):
            return engine
        reason = f" ({status.reason})" if status.reason else ""
        if status.state in ("loading", "starting", "warming"):
            raise ServeError(
                503,
                f"the model is not ready yet: {status.state}{reason}; retry shortly (GET /ready says when)",
                code="engine_unavailable",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        raise ServeError(
            503,
            f"the Engine is {status.state}{reason} and serves no more requests; restart the server",
            code="engine_failed",
        )

    @property
    def purpose(self) -> str | None:
        engine = self.loaded
        return engine.config.purpose if engine is not None else None

    @property
    def max_context(self) -> int | None:
        engine = self.loaded
        return engine.max_context if engine is not None else None

    @property
    def scoring_window(self) -> tuple[int, int] | None:
        """``(score_window, score_stride)`` of a loaded causal_scoring Engine; ``None`` otherwise."""
        engine = self.loaded
        if engine is None or engine.config.purpose != "causal_scoring":
            return None
        return engine.config.score_window, engine.config.score_stride
