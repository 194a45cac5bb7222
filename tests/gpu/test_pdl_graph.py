"""The decode step under programmatic dependent launch equals the same step without it, bit for bit.

The fast kernels read settled data before their PDL wait (bound weights, the residual stream, the GDN and
conv state written by an earlier step) and, at one row, let the next kernel launch before their own wait
(`ninfer.ops.triton.pdl`). A wrong claim of "settled" is a race: a kernel reading what its predecessor is
still writing. The oracle is the same forward with PDL off (every kernel waits for the previous one to
finish), run eagerly; the candidate is the CUDA graph the Engine replays, with PDL on. Four layers of the
real packages' dims (three GDN layers and an attention layer), random weights, random state, the state
updated in place so that each step reads what the previous one wrote.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from ninfer.ops.triton import pdl  # noqa: E402
from ninfer.targets.qwen3_6.binder import random_model_view  # noqa: E402
from ninfer.targets.qwen3_6.kernels import select_kernels  # noqa: E402
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward  # noqa: E402
from ninfer.targets.registry import get_package  # noqa: E402

STEPS = 3
CONTEXT, PAGE_SIZE = 300, 64  # a context that is not a multiple of the page


def _batch(rows: int, device: torch.device) -> StepBatch:
    """One decode token per row at the end of CONTEXT positions; each row updates its own slot in place."""
    pages = -(-CONTEXT // PAGE_SIZE)
    gen = torch.Generator().manual_seed(rows)
    slots = torch.cat([r * pages * PAGE_SIZE + torch.tensor([CONTEXT - 1]) for r in range(rows)])
    state = torch.arange(rows, device=device)
    qs = list(range(rows + 1))
    return StepBatch(
        token_ids=torch.randint(1000, 100000, (rows,), generator=gen).to(device),
        positions=torch.full((3, rows), CONTEXT - 1, device=device),
        query_start=torch.tensor(qs, dtype=torch.int32, device=device),
        context_lens=torch.full((rows,), CONTEXT, dtype=torch.int32, device=device),
        block_table=torch.arange(rows * pages, dtype=torch.int32, device=device).view(rows, pages),
        slot_mapping=slots.to(device),
        state_in=state,
        state_out=state,
        fresh=torch.zeros(rows, dtype=torch.bool, device=device),
        query_start_host=tuple(qs),
        context_lens_host=(CONTEXT,) * rows,
    )


def _random_store(variant: object, rows: int, device: torch.device) -> StateStore:
    pages = rows * -(-CONTEXT // PAGE_SIZE)
    store = StateStore.allocate(variant, rows, pages, PAGE_SIZE, torch.bfloat16, device)
    gen = torch.Generator(device=device).manual_seed(7)
    for pool in (store.conv, store.rec, store.k_pages, store.v_pages):
        pool.copy_(torch.randn(pool.shape, generator=gen, device=device) * 0.5)
    return store


def _copy_store(store: StateStore) -> StateStore:
    return StateStore(*(t.clone() for t in (store.conv, store.rec, store.k_pages, store.v_pages)))


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("package", ["qwen3_6_35b_a3b", "qwen3_6_27b"])
def test_graph_under_pdl_equals_eager_without_pdl(
    package: str, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not pdl.ENABLED:
        pytest.skip("programmatic dependent launch is off on this GPU")
    device = torch.device("cuda")
    variant = dataclasses.replace(get_package(package).variant, num_layers=4)
    view = random_model_view(variant, seed=0, dtype=torch.bfloat16, device=device)
    kernels = select_kernels(device, "fast")
    batch = _batch(rows, device)
    initial = _random_store(variant, rows, device)

    def step(store: StateStore) -> torch.Tensor:
        return forward(view, variant, batch, store, logits="last", kernels=kernels).logits

    with torch.inference_mode():
        # the oracle: PDL off, eager
        oracle = _copy_store(initial)
        with monkeypatch.context() as off:
            off.setattr(pdl, "ENABLED", False)
            off.setattr(pdl, "LAUNCH", {})
            want = [step(oracle).clone() for _ in range(STEPS)]

        # the candidate: PDL on, one CUDA graph replayed STEPS times from the same initial state
        store = _copy_store(initial)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step(store)  # compiles
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step(store)
        for target, source in zip(
            (store.conv, store.rec, store.k_pages, store.v_pages),
            (initial.conv, initial.rec, initial.k_pages, initial.v_pages),
            strict=True,
        ):
            target.copy_(source)
        for s in range(STEPS):
            logits.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(logits, want[s]), f"step {s}: logits differ from the PDL-free step"
    assert torch.equal(store.conv, oracle.conv) and torch.equal(store.rec, oracle.rec)
    assert torch.equal(store.k_pages, oracle.k_pages) and torch.equal(store.v_pages, oracle.v_pages)
