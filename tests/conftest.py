"""Shared fixtures: tiny random-weight artifacts (written once per session) and CPU thread limits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_artifacts.py importable from any test

from tiny_artifacts import write_tiny_artifact  # noqa: E402

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_artifact("qwen3_6_tiny", tmp_path_factory.mktemp("art") / "qwen3_6_tiny.ninfer")


@pytest.fixture(scope="session")
def tiny_dflash_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense package's artifact with its registered DFlash drafter's weights too."""
    path = tmp_path_factory.mktemp("art") / "qwen3_6_tiny_dflash.ninfer"
    return write_tiny_artifact("qwen3_6_tiny", path, drafter=True)


@pytest.fixture(scope="session")
def tiny_moe_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_artifact("qwen3_6_tiny_moe", tmp_path_factory.mktemp("art") / "qwen3_6_tiny_moe.ninfer")
