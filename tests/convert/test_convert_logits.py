"""End to end: a converted artifact, bound by the family binder, gives transformers' logits.

The oracle is transformers' ``Qwen3_5(Moe)ForConditionalGeneration.from_pretrained`` on the very
checkpoint folder the converter read (per-expert MoE layout as transformers saves it), so a converter
mapping error (wrong name, swapped gate/up halves, transposed expert) shows as a logits mismatch.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from convert_ckpt_helpers import save_tiny_checkpoint
from ninfer_tools.convert.qwen3_6 import convert

from ninfer.targets.qwen3_6.binder import load_model_view
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward

torch.set_num_threads(1)

TOKENS = [248045, 846, 198, 9707, 11, 1879, 0, 151, 3000, 248046, 198, 248045, 77091, 198, 248068, 271, 5]


def ninfer_logits(artifact: Path, tokens: list[int]) -> torch.Tensor:
    """All-position fp32 logits of one fresh sequence through the family forward on CPU."""
    package, view = load_model_view(artifact, "cpu", torch.float32)
    v = package.variant
    page_size = 16
    n_pages = -(-len(tokens) // page_size)
    store = StateStore.allocate(
        v, num_slots=1, num_pages=n_pages, page_size=page_size, dtype=torch.float32, device="cpu"
    )
    n = len(tokens)
    batch = StepBatch(
        token_ids=torch.tensor(tokens, dtype=torch.long),
        positions=torch.arange(n, dtype=torch.long).expand(3, -1).contiguous(),
        query_start=torch.tensor([0, n], dtype=torch.int32),
        context_lens=torch.tensor([n], dtype=torch.int32),
        block_table=torch.arange(n_pages, dtype=torch.int32)[None],
        slot_mapping=torch.arange(n, dtype=torch.long),
        state_in=torch.tensor([0]),
        state_out=torch.tensor([0]),
        fresh=torch.tensor([True]),
    )
    with torch.no_grad():
        out = forward(view, v, batch, store, logits="all")
    assert out.logits is not None
    return out.logits


def hf_logits(hf_dir: Path, moe: bool, tokens: list[int]) -> torch.Tensor:
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration

    cls = Qwen3_5MoeForConditionalGeneration if moe else Qwen3_5ForConditionalGeneration
    model = cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()


@pytest.mark.parametrize("package_name", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_converted_artifact_matches_transformers_logits(package_name: str, tmp_path: Path) -> None:
    hf_dir = save_tiny_checkpoint(package_name, tmp_path / "hf", seed=3)
    artifact = convert(hf_dir, tmp_path / "model.ninfer", dtype="fp32", progress=False)
    ours = ninfer_logits(artifact, TOKENS)
    theirs = hf_logits(hf_dir, "moe" in package_name, TOKENS)
    assert ours.shape == theirs.shape == (len(TOKENS), 248320)
    rel = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    assert rel <= 1e-4, f"relative logits error {rel:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
