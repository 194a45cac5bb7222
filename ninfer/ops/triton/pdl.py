"""Programmatic dependent launch (Hopper and later), on by default there; ``NINFER_PDL=0`` turns it off.
It shortens every decode step on the H200 (docs/benchmarks.md, "Why the kernels are as they are", PDL).

A decode step is hundreds of small kernels in a row (several hundred per 27B step at B = 1), and each one
pays the launch and block-scheduling latency after the previous kernel has fully drained. With PDL every
Triton kernel here is launched with the programmatic-serialisation attribute and starts with `enter`:
it first waits for the previous kernel to complete and flush (``griddepcontrol.wait``), then lets the
next kernel launch (``griddepcontrol.launch_dependents``), whose blocks are then scheduled while this
one runs and wait in their own `enter`. Code before the wait runs while the previous kernel still does,
so it may read only memory that is complete before this kernel can launch, and write nothing: static
weights (`skinny_gemm`'s early tiles, the norms' weights), state pools written by an earlier step (the
GDN recurrence and conv step), or data whose writer finished before the kernel ahead of this one passed
its own wait (two launches back when that kernel launches this one after its wait, as `enter` does; three
when it launches it early, below): the residual stream in `norm` (four launches back), the logits of
`moe_decode`'s early down kernel (two), the normed x of its gate/up launch's shared-expert gate (two),
the step's inputs (slots, lengths, block tables: unpacked at the step's start) in the attention prologue,
the recurrence and the decode attention, and the K/V of every position but the newest in the decode
attention. Results are unchanged. Kernels of other libraries (cuBLAS, torch) in between keep ordinary
stream order. CUDA-graph capture records the programmatic edges (CUDA 12.3+).

A kernel may also let the next one launch before its own wait (`launch_next` ... `enter_after`, or
`enter_launching_next` where nothing loads before the wait; the ops' ``launch_next_early=True``). The
next kernel's code before its wait then runs while this one's predecessor may still run (and, along a
chain of such kernels, the predecessors up to the last kernel that launched its successor after its own
wait), so it must read nothing but static weights, earlier steps' state and data complete before that
kernel passed its wait (the norm after the MoE down launch: the residual stream, four launches back). The
fast table asks for it in one-row decode only, along the chains that end in a GEMV whose weights
load before its wait (35B-A3B at B = 1: the GDN conv step -> recurrence -> gated norm -> gdn_out; the
attention prologue -> split-KV attention -> merge with the output gate -> o_proj; a norm -> the next
projection; the MoE down launch -> the norm): that GEMV's weights then stream while the small kernels
before it run. At eight rows it was slower, for a reason not established (docs/benchmarks.md, PDL).
`ninfer.ops.pdl_policy` decides these flags for a step, in one place.

The distances these rules rest on are checked, not trusted: every launch here reports its flags, what
it reads before its wait and what it writes to `ninfer.ops.triton.schedule` while a schedule is being
recorded, and `checked_schedule` (re-exported here) asserts, at the end of a recorded step (a graph
capture, or an eager step), that no read before a wait overlaps what a kernel not yet guaranteed
complete writes; the exact rule is that module's docstring.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from ninfer.ops.triton.schedule import PdlScheduleError, checked_schedule, recorded_schedule

__all__ = [
    "ENABLED",
    "LAUNCH",
    "PdlScheduleError",
    "checked_schedule",
    "recorded_schedule",
    "enter",
    "enter_after",
    "enter_launching_next",
    "launch_dependents",
    "launch_next",
    "wait",
]


def _enabled() -> bool:
    if os.environ.get("NINFER_PDL", "1") != "1" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        return False
    try:  # Triton builds without grid-dependency control keep the plain launch
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401
    except ImportError:
        return False
    return True


ENABLED: bool = _enabled()
LAUNCH: dict[str, bool] = {"launch_pdl": True} if ENABLED else {}  # extra launch options of every kernel


@triton.jit
def wait(USE_PDL: tl.constexpr):
    """Wait for the previous kernel to complete and flush its writes (a no-op without PDL)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel launch: after `wait` in `enter` (so that the next kernel's reads before its own
    wait find everything up to this kernel's predecessor complete), before it in `launch_next`."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """A kernel's first statement: wait for the previous kernel, then let the next one launch."""
    wait(USE_PDL)
    launch_dependents(USE_PDL)


@triton.jit
def launch_next(LAUNCH_NEXT_EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    """A kernel's first statement when it may let the next one launch before its own wait."""
    if LAUNCH_NEXT_EARLY:
        launch_dependents(USE_PDL)


@triton.jit
def enter_launching_next(LAUNCH_NEXT_EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    """`enter` of a kernel that loads nothing before its wait; with LAUNCH_NEXT_EARLY it lets the next
    kernel launch first."""
    launch_next(LAUNCH_NEXT_EARLY, USE_PDL)
    enter_after(LAUNCH_NEXT_EARLY, USE_PDL)


@triton.jit
def enter_after(LAUNCH_NEXT_EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    """`enter` of a kernel that began with `launch_next`: only the wait is left if it launched early."""
    if LAUNCH_NEXT_EARLY:
        wait(USE_PDL)
    else:
        enter(USE_PDL)
