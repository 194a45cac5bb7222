"""The family forward equals transformers' Qwen3_5(Moe)ForCausalLM (fp32, CPU, randomised norms)."""

from __future__ import annotations

import math

import pytest
import torch
from qwen3_6_model_harness import (
    TINY_PACKAGES,
    RowStep,
    SeqState,
    hf_logits,
    hf_model,
    random_tokens,
    rel_err,
    run_step,
    step,
    tiny_view,
)

from ninfer.targets.qwen3_6.model import StateStore

torch.set_num_threads(1)

PAGE_SIZE = 16
TOLERANCE = 1e-4


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
@pytest.mark.parametrize("length", [1, 7, 70, 130])
def test_full_forward_matches_transformers(package_name: str, length: int) -> None:
    view = tiny_view(package_name)
    tokens = random_tokens(length, seed=100 + length)
    expected = hf_logits(package_name, tokens)

    n_pages = math.ceil(length / PAGE_SIZE)
    store = StateStore.allocate(view.variant, 3, n_pages + 2, PAGE_SIZE, torch.float32, "cpu")
    pages = list(range(n_pages + 1, 0, -1))[:n_pages]  # reversed, skipping page 0: pages are data
    row = RowStep(tokens, past=0, pages=pages, state_in=2, state_out=1, fresh=True)
    out = run_step(view, store, [row], logits="all")

    assert out.logits is not None and out.logits.dtype == torch.float32
    assert out.logits.shape == (length, view.variant.vocab_size)
    assert out.hidden.shape == (length, view.variant.hidden_size)
    err = rel_err(out.logits, expected)
    print(f"{package_name} T={length}: rel err {err:.2e}")
    assert err <= TOLERANCE


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_logits_modes(package_name: str) -> None:
    """'last' returns each row's last-token logits, 'none' none, with the same hidden states."""
    view = tiny_view(package_name)
    variant = view.variant
    rows = [
        RowStep(random_tokens(5, seed=1), 0, [0], 0, 0, fresh=True),
        RowStep(random_tokens(3, seed=2), 0, [1], 1, 1, fresh=True),
    ]
    outs = {}
    for mode in ("all", "last", "none"):
        store = StateStore.allocate(variant, 2, 2, PAGE_SIZE, torch.float32, "cpu")
        outs[mode] = run_step(view, store, rows, logits=mode)
    assert outs["none"].logits is None
    assert outs["last"].logits is not None and outs["all"].logits is not None
    assert outs["last"].logits.shape == (2, variant.vocab_size)
    assert rel_err(outs["last"].logits, outs["all"].logits[[4, 7]]) <= 1e-6  # matmul M differs
    torch.testing.assert_close(outs["none"].hidden, outs["all"].hidden, rtol=0, atol=0)


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_greedy_generation_matches_transformers_generate(package_name: str) -> None:
    from transformers import GenerationConfig

    view = tiny_view(package_name)
    prompt = random_tokens(11, seed=7)
    config = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        generated = hf_model(package_name).generate(torch.tensor([prompt]), generation_config=config)
    expected = generated[0, len(prompt) :].tolist()
    assert len(expected) == 8

    store = StateStore.allocate(view.variant, 2, 4, PAGE_SIZE, torch.float32, "cpu")
    seq = SeqState(pages=[3, 1], slot=0)
    feed, ours = prompt, []
    for i in range(8):
        logits = step(view, store, [(seq, feed, i % 2)])  # GDN state flips between slots 0 and 1
        feed = [int(logits[0].argmax())]
        ours += feed
    assert ours == expected
