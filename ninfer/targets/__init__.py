"""Exact target packages, the Qwen3.6 family they instantiate, and the one way the Engine opens them."""

from __future__ import annotations

from typing import Any


def open_target(artifact_path: str, config: Any) -> Any:
    """Open a `.ninfer` artifact as (Program, Frontend) for an EngineConfig; see `ninfer.targets.open`."""
    from ninfer.targets.open import open_target as _open

    return _open(artifact_path, config)
