"""NInfer: a single-GPU inference engine for the Qwen3.6 model family.

``import ninfer`` stays light (no torch): the public values come from ``ninfer.types`` and the Engine
facade is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ninfer.types import (
    Availability,
    EngineConfig,
    EngineFailed,
    GenerationDelta,
    GenerationEvent,
    GenerationRequest,
    GenerationResult,
    GenerationStart,
    NInferError,
    OutputConstraint,
    RequestFailed,
    RequestRejected,
    ScoreResult,
    TokenLogprob,
    ToolCallDelta,
    Usage,
)

if TYPE_CHECKING:
    from ninfer.runtime.engine.engine import Engine, GenerationHandle

__all__ = [
    "Availability",
    "Engine",
    "EngineConfig",
    "EngineFailed",
    "GenerationDelta",
    "GenerationEvent",
    "GenerationHandle",
    "GenerationRequest",
    "OutputConstraint",
    "GenerationResult",
    "GenerationStart",
    "NInferError",
    "RequestFailed",
    "RequestRejected",
    "ScoreResult",
    "TokenLogprob",
    "ToolCallDelta",
    "Usage",
]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "GenerationHandle"):
        from ninfer.runtime.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
