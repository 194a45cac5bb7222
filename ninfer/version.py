"""NInfer's version: the installed distribution's, else the source tree's ``pyproject.toml`` (run from a
checkout without installing). ``ninfer --version`` and the server's ``GET /version`` report it."""

from __future__ import annotations

import functools


@functools.cache
def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("ninfer")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        if not pyproject.is_file():
            return "unknown"
        return tomllib.loads(pyproject.read_text())["project"]["version"]
