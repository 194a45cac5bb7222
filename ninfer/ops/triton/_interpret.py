"""Run a kernel module's @triton.jit functions in the Triton CPU interpreter, without leaking the mode.

`@triton.jit` decides at decoration time whether a function is compiled or interpreted, from the
TRITON_INTERPRET environment variable. `load_interpreted` executes a private copy of a kernel module with
the variable set (the canonical module in sys.modules is untouched, so GPU tests in the same process still
get compiled kernels); `interpreter_env` keeps the variable set while those copies run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from types import ModuleType

_ENV = "TRITON_INTERPRET"
_loaded: dict[str, ModuleType] = {}


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """Set TRITON_INTERPRET=1 for the duration of the block, restoring the previous value after."""
    previous = os.environ.get(_ENV)
    os.environ[_ENV] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = previous


def load_interpreted(module_name: str) -> ModuleType:
    """A private copy of `module_name` whose jitted kernels run in the interpreter (cached per name)."""
    if module_name in _loaded:
        return _loaded[module_name]
    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot find module {module_name}")
    module = importlib.util.module_from_spec(spec)  # deliberately not registered in sys.modules
    with interpreter_env():
        spec.loader.exec_module(module)
    _loaded[module_name] = module
    return module
