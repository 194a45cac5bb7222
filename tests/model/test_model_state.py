"""Explicit state: prefill + decode and chunked prefill equal one forward; batched rows equal rows alone.

Slots and pages are arbitrary permutations (and a fresh row reads a slot that holds another
sequence's state), so the tests fail if the model ever assumes a layout instead of reading the data.
"""

from __future__ import annotations

import pytest
import torch
from qwen3_6_model_harness import (
    TINY_PACKAGES,
    RowStep,
    SeqState,
    clone_store,
    hf_logits,
    random_tokens,
    rel_err,
    run_step,
    step,
    tiny_view,
)

from ninfer.targets.qwen3_6.model import StateStore

torch.set_num_threads(1)

PAGE_SIZE = 16  # divides none of the lengths below
HF_TOLERANCE = 1e-4
BATCH_TOLERANCE = 1e-5  # batched vs alone: same math, only matmul blocking differs


def assert_stores_match(actual: StateStore, expected: StateStore) -> None:
    for field in ("conv", "rec", "k_pages", "v_pages"):
        a, e = getattr(actual, field), getattr(expected, field)
        assert rel_err(a, e) <= BATCH_TOLERANCE, field


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
def test_prefill_then_decode_matches_full_forward(package_name: str) -> None:
    """Prefill 37 tokens, decode 8 one at a time (state read and written in place): HF at every step."""
    view = tiny_view(package_name)
    tokens = random_tokens(45, seed=3)
    expected = hf_logits(package_name, tokens)

    store = StateStore.allocate(view.variant, 4, 8, PAGE_SIZE, torch.float32, "cpu")
    seq = SeqState(pages=[6, 2, 5], slot=0)
    logits = step(view, store, [(seq, tokens[:37], 3)])
    errors = [rel_err(logits[0], expected[36])]
    for t in range(37, 45):
        logits = step(view, store, [(seq, [tokens[t]], 3)])  # state_out == state_in
        errors.append(rel_err(logits[0], expected[t]))
    print(f"{package_name}: max rel err over prefill + 8 decode steps {max(errors):.2e}")
    assert max(errors) <= HF_TOLERANCE


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
@pytest.mark.parametrize(("length", "cuts"), [(37, (11, 30)), (130, (64, 100))])
def test_chunked_prefill_matches_one_shot(package_name: str, length: int, cuts: tuple[int, int]) -> None:
    view = tiny_view(package_name)
    tokens = random_tokens(length, seed=length)
    pages = [8, 0, 4, 7, 1, 3, 6, 2, 5][: -(-length // PAGE_SIZE)]

    one_shot_store = StateStore.allocate(view.variant, 3, 9, PAGE_SIZE, torch.float32, "cpu")
    one_shot = step(view, one_shot_store, [(SeqState(pages, slot=2), tokens, 1)])

    chunked_store = StateStore.allocate(view.variant, 3, 9, PAGE_SIZE, torch.float32, "cpu")
    seq = SeqState(pages, slot=2)
    bounds = (0, *cuts, length)
    chunk_logits = []
    for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        # flip 0 -> 2 -> 1 so the last chunk writes the slot the one-shot prefill wrote
        chunk_logits.append(step(view, chunked_store, [(seq, tokens[start:end], (0, 2, 1)[i])])[0])

    assert rel_err(chunk_logits[-1], one_shot[0]) <= BATCH_TOLERANCE
    expected = hf_logits(package_name, tokens)
    for end, logits in zip(bounds[1:], chunk_logits):
        assert rel_err(logits, expected[end - 1]) <= HF_TOLERANCE
    # the final state (slot 1) and every KV slot equal the one-shot prefill's
    for field in ("conv", "rec"):
        assert (
            rel_err(getattr(chunked_store, field)[:, 1], getattr(one_shot_store, field)[:, 1])
            <= BATCH_TOLERANCE
        )
    for field in ("k_pages", "v_pages"):
        assert rel_err(getattr(chunked_store, field), getattr(one_shot_store, field)) <= BATCH_TOLERANCE


@pytest.mark.parametrize("package_name", TINY_PACKAGES)
@pytest.mark.parametrize("layout_seed", [0, 1])
def test_batched_rows_equal_rows_alone(package_name: str, layout_seed: int) -> None:
    """A B=3 decode step and a mixed varlen step (1, 3, 6 tokens and a fresh 9-token row) equal each
    row run alone, and each row's logits equal transformers on that row's whole history."""
    view = tiny_view(package_name)
    perm = torch.Generator().manual_seed(layout_seed)
    slots = torch.randperm(10, generator=perm).tolist()
    pages = torch.randperm(12, generator=perm).tolist()
    store = StateStore.allocate(view.variant, 10, 12, PAGE_SIZE, torch.float32, "cpu")

    # a: 5 tokens, b: 20, c: 37 prefilled alone; d starts fresh in the mixed step
    a, b, c = SeqState(pages[0:1], slots[0]), SeqState(pages[1:3], slots[1]), SeqState(pages[3:6], slots[2])
    d = SeqState(pages[6:7], slots[3])
    for seq, n, out_slot, seed in ((a, 5, slots[4], 11), (b, 20, slots[5], 12), (c, 37, slots[6], 13)):
        step(view, store, [(seq, random_tokens(n, seed), out_slot)])
    d.slot = c.slot  # the fresh row "reads" a slot holding c's state: fresh must ignore it

    decode = [(c, [101], slots[2]), (a, [102], slots[0]), (b, [103], slots[1])]
    mixed = [
        (b, [201, 202, 203], slots[5]),
        (d, random_tokens(9, 14), slots[3]),
        (a, [204], slots[4]),
        (c, [205, 206, 207, 208, 209, 210], slots[6]),
    ]
    for feeds in (decode, mixed):
        alone_store = clone_store(store)
        alone_seqs = {id(seq): _copy(seq) for seq, _, _ in feeds}
        batched = step(view, store, feeds)
        for row, (seq, tokens, out_slot) in enumerate(feeds):
            alone = step(view, alone_store, [(alone_seqs[id(seq)], tokens, out_slot)])
            assert rel_err(batched[row], alone[0]) <= BATCH_TOLERANCE, f"row {row}"
            assert rel_err(batched[row], hf_logits(package_name, seq.history)[-1]) <= HF_TOLERANCE
        assert_stores_match(store, alone_store)


def _copy(seq: SeqState) -> SeqState:
    twin = SeqState(seq.pages, seq.slot)
    twin.history = list(seq.history)
    return twin


def test_fresh_row_ignores_its_state_slot() -> None:
    """Garbage in the slot a fresh row names changes nothing; a non-fresh row does read it."""
    view = tiny_view("qwen3_6_tiny")
    tokens = random_tokens(6, seed=5)
    row = RowStep(tokens, past=0, pages=[0], state_in=0, state_out=1, fresh=True)
    clean = StateStore.allocate(view.variant, 2, 1, PAGE_SIZE, torch.float32, "cpu")
    dirty = StateStore.allocate(view.variant, 2, 1, PAGE_SIZE, torch.float32, "cpu")
    dirty.conv[:, 0].normal_()
    dirty.rec[:, 0].normal_()
    reference = run_step(view, clean, [row]).logits
    assert torch.equal(run_step(view, dirty, [row]).logits, reference)
    stale = RowStep(tokens, past=0, pages=[0], state_in=0, state_out=1, fresh=False)
    assert rel_err(run_step(view, dirty, [stale]).logits, reference) > 1e-3
