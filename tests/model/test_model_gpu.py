"""CUDA: bf16 follows the fp32 CPU forward (prefill crossing a 64-token chunk, then decode), and a decode
step replays from a CUDA graph."""

from __future__ import annotations

import pytest
import torch
from qwen3_6_model_harness import (
    TINY_PACKAGES,
    SeqState,
    clone_store,
    make_batch,
    random_tokens,
    rel_err,
    step,
    tiny_view,
)

from ninfer.targets.qwen3_6.model import StateStore, forward
from ninfer.targets.qwen3_6.view import ModelView

BF16_TOLERANCE = 2e-2


def _prefill_and_decode(view: ModelView, tokens: list[int], prompt_len: int) -> list[torch.Tensor]:
    store = StateStore.allocate(view.variant, 2, 8, 16, view.dtype, view.device)
    seq = SeqState(pages=[5, 1, 7, 3, 0, 6], slot=0)
    logits = [step(view, store, [(seq, tokens[:prompt_len], 1)])[0]]
    for t in range(prompt_len, len(tokens)):
        logits.append(step(view, store, [(seq, [tokens[t]], t % 2)])[0])
    return [x.float().cpu() for x in logits]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_bf16_cuda_forward_matches_fp32_cpu(package_name: str) -> None:
    cpu_view = tiny_view(package_name)
    cuda_view = cpu_view.to("cuda", torch.bfloat16)
    tokens = random_tokens(74, seed=21)
    expected = _prefill_and_decode(cpu_view, tokens, prompt_len=70)
    actual = _prefill_and_decode(cuda_view, tokens, prompt_len=70)
    errors = [rel_err(a, e) for a, e in zip(actual, expected)]
    print(f"{package_name}: bf16 CUDA vs fp32 CPU max rel err {max(errors):.3e} (per step {errors})")
    assert max(errors) <= BF16_TOLERANCE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_decode_step_replays_from_a_cuda_graph(package_name: str) -> None:
    """A B=3 decode step has no host sync: captured once in a CUDA graph, its replay equals eager."""
    view = tiny_view(package_name).to("cuda", torch.bfloat16)
    variant = view.variant
    store = StateStore.allocate(variant, 6, 9, 16, torch.bfloat16, "cuda")
    seqs = [SeqState([0, 4], 0), SeqState([8, 2, 6], 1), SeqState([3], 2)]
    for seq, n, seed in zip(seqs, (20, 35, 6), (31, 32, 33)):
        step(view, store, [(seq, random_tokens(n, seed), seq.slot + 3)])
    batch = make_batch([seq.row([100 + i], seq.slot - 3) for i, seq in enumerate(seqs)], 16, "cuda")
    assert batch.is_decode

    eager_store = clone_store(store)
    with torch.no_grad():
        eager = forward(view, variant, batch, eager_store)
        initial = clone_store(store)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture, as torch.cuda.graph requires
            forward(view, variant, batch, store)
        torch.cuda.current_stream().wait_stream(side)
        for field in ("conv", "rec", "k_pages", "v_pages"):
            getattr(store, field).copy_(getattr(initial, field))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = forward(view, variant, batch, store)
        graph.replay()
    torch.cuda.synchronize()
    assert eager.logits is not None and captured.logits is not None
    assert rel_err(captured.logits, eager.logits) <= 1e-6
    for field in ("conv", "rec", "k_pages", "v_pages"):
        assert rel_err(getattr(store, field), getattr(eager_store, field)) <= 1e-6, field
