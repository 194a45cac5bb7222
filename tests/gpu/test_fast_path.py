"""The fast op table (Triton kernels, fla-core prefill, SDPA) against the reference table on CUDA.

Same Engine, same artifact, only `EngineConfig.kernels` differs: greedy tokens must be equal (fp32, so
that rounding cannot flip an argmax of the random tiny models), and the bundled demo model (trained,
bf16) must give the same greedy text. Prompts cover one-token prompts (a fresh row in the decode
kernels), short prompts, and long ones split into prefill chunks (bottom-right causal attention over a
cached prefix, fla varlen with an initial state).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ninfer import Engine, EngineConfig, GenerationRequest
from ninfer.targets.open import open_target
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [[1000 + i] for i in range(2)] + [
    list(range(100 + 7 * i, 100 + 7 * i + 3 + 41 * i)) for i in range(6)
]  # lengths 1, 1, 3, 44, 85, 126, 167, 208


def _tokens(artifact: Path, kernels: str, dtype: str, chunk: int) -> list[tuple[int, ...]]:
    config = EngineConfig(
        max_concurrency=8, device="cuda", dtype=dtype, kernels=kernels, prefill_chunk_tokens=chunk
    )
    with Engine(artifact, config) as engine:
        handles = [
            engine.submit(GenerationRequest(prompt=p, max_tokens=16 + i, temperature=0.0, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        ]
        return [h.result().token_ids for h in handles]


@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_fast_tokens_equal_reference_tokens(
    package: str, tiny_artifact: Path, tiny_moe_artifact: Path
) -> None:
    artifact = tiny_artifact if package == "qwen3_6_tiny" else tiny_moe_artifact
    reference = _tokens(artifact, "reference", "float32", chunk=64)
    fast = _tokens(artifact, "fast", "float32", chunk=64)
    assert fast == reference


def _teacher_forced_logits(
    artifact: Path, kernels: str, dtype: str, ids: list[int], prefill: int
) -> torch.Tensor:
    """Logits of every position of ``ids``: one prefill of the first ``prefill`` tokens (all logits),
    then one decode step per remaining token, through the given op table: [len(ids), V] fp32."""
    config = EngineConfig(max_concurrency=1, device="cuda", dtype=dtype, kernels=kernels)
    program = open_target(str(artifact), config).program
    page_size, n = 64, len(ids)
    store = StateStore.allocate(program.variant, 2, -(-n // page_size), page_size, program.view.dtype, "cuda")
    i32 = {"dtype": torch.int32, "device": "cuda"}
    tokens = torch.tensor(ids, device="cuda")
    table = torch.arange(-(-n // page_size), **i32).unsqueeze(0)
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    pos = torch.arange(prefill, device="cuda")
    batch = StepBatch(
        token_ids=tokens[:prefill],
        positions=pos.expand(3, -1),
        query_start=torch.tensor([0, prefill], **i32),
        context_lens=torch.tensor([prefill], **i32),
        block_table=table,
        slot_mapping=pos,
        state_in=slot,
        state_out=slot,
        fresh=torch.ones(1, dtype=torch.bool, device="cuda"),
        query_start_host=(0, prefill),
        context_lens_host=(prefill,),
    )
    with torch.inference_mode():
        out = [
            forward(program.view, program.variant, batch, store, logits="all", kernels=program.kernels).logits
        ]
        for p in range(prefill, n):
            step = StepBatch(
                token_ids=tokens[p : p + 1],
                positions=torch.full((3, 1), p, device="cuda"),
                query_start=torch.tensor([0, 1], **i32),
                context_lens=torch.tensor([p + 1], **i32),
                block_table=table,
                slot_mapping=torch.tensor([p], device="cuda"),
                state_in=slot,
                state_out=slot,
                fresh=torch.zeros(1, dtype=torch.bool, device="cuda"),
            )
            out.append(forward(program.view, program.variant, step, store, kernels=program.kernels).logits)
    return torch.cat(out).float()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("package", ["qwen3_6_tiny_moe", "qwen3_6_demo"])
def test_fast_bf16_is_as_accurate_as_reference_bf16(package: str, tiny_moe_artifact: Path) -> None:
    """In bf16 neither table is exact: the fast one must be about as close to the fp32 reference as the
    reference op table in bf16 is, and pick the same greedy token almost everywhere."""
    from ninfer.cli.common import bundled_artifact

    artifact = tiny_moe_artifact if package == "qwen3_6_tiny_moe" else Path(bundled_artifact())
    ids = [(37 * i + 11) % 5000 + 300 for i in range(170)]
    exact = _teacher_forced_logits(artifact, "reference", "float32", ids, prefill=150)
    reference = _teacher_forced_logits(artifact, "reference", "bfloat16", ids, prefill=150)
    fast = _teacher_forced_logits(artifact, "fast", "bfloat16", ids, prefill=150)
    assert not fast.isnan().any()
    err_fast, err_reference = _rel(fast, exact), _rel(reference, exact)
    print(f"\n{package}: bf16 vs fp32 logits rel. error: fast {err_fast:.2e}, reference {err_reference:.2e}")
    assert err_fast <= 1.5 * err_reference + 2e-3, (err_fast, err_reference)
    agree = (fast.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree >= 0.95, agree
