"""Which prefill chunk sizes the Program captures as graphs, and the Engine option that bounds them."""

from __future__ import annotations

import pytest
import torch

from ninfer import EngineConfig
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, prefill_capacities


def _config(tokens: int, context: int) -> ProgramConfig:
    return ProgramConfig(
        max_concurrency=1, max_context=context, page_size=64, kv_pages=16, device=torch.device("cpu"),
        dtype=torch.float32, prefill_graph_tokens=tokens,
    )  # fmt: skip


def test_capacities_double_from_64_to_the_option_and_the_context() -> None:
    assert prefill_capacities(_config(1024, 32768)) == [64, 128, 256, 512, 1024]
    assert prefill_capacities(_config(1000, 32768)) == [64, 128, 256, 512]
    assert prefill_capacities(_config(4096, 300)) == [64, 128, 256]
    assert prefill_capacities(_config(0, 32768)) == []
    assert prefill_capacities(_config(63, 32768)) == []


def test_a_negative_option_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="prefill_graph_tokens"):
        EngineConfig(prefill_graph_tokens=-1)
