"""Run a Triton kernel test module's CPU tests in the Triton interpreter, in a child Python.

The child has TRITON_INTERPRET=1 from its start, so `@triton.jit` decorates every kernel as interpreted:
once another test module has imported transformers (which loads triton), kernels created later in the
same process cannot be interpreted reliably. The parent runs the child once and the `gpu` tests itself.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from types import ModuleType

import pytest
import torch

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (elementwise ratios blow up near zero), in fp32."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30)).item()


def run_interpreter_child(test_file: str) -> None:
    """The parent's one test: the module's non-gpu tests, in the interpreter, must all pass."""
    if IN_CHILD:
        pytest.skip("this is the interpreter child")
    pytest.importorskip("triton")
    argv = [sys.executable, "-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", "-m", "not gpu"]
    child = subprocess.run(
        [*argv, test_file],
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-2000:]
    assert " passed" in child.stdout and " failed" not in child.stdout, child.stdout[-2000:]


def interpreted_kernels(module_name: str) -> ModuleType:
    """The kernel module, interpreted: only in the child (elsewhere the CPU test is skipped)."""
    if not IN_CHILD:
        pytest.skip("runs in the interpreter child (test_interpreter_suite_in_a_fresh_process)")
    return importlib.import_module(module_name)
