"""`ninfer generate` passes only the sampling flags the user gave; the Engine fills the rest from the
model's generation config, as it does for `ninfer serve` and `ninfer chat`.

Run on the bundled demo model (its config: do_sample true, temperature 0.6, top_p 0.95, top_k 20,
repetition_penalty 1.1), reading the RequestPlan the Engine makes for the one request.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from ninfer import Engine, GenerationRequest
from ninfer.cli.main import main
from ninfer.runtime.contract.types import RequestPlan, SamplingParams

torch.set_num_threads(1)
BASE = (
    "generate",
    "def add(a, b):",
    "--raw",
    "--max-tokens",
    "2",
    "--seed",
    "3",
    "--json",
    "--device",
    "cpu",
)


def run_generate(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[GenerationRequest, SamplingParams]:
    """The request the command submitted and the sampling the Engine planned for it."""
    seen: list[tuple[GenerationRequest, RequestPlan]] = []
    real_plan = Engine._plan

    def plan(self: Engine, request: GenerationRequest, prompt: Any) -> RequestPlan:
        seen.append((request, real_plan(self, request, prompt)))
        return seen[-1][1]

    monkeypatch.setattr(Engine, "_plan", plan)
    capsys.readouterr()
    rc = main([*BASE, *flags])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["usage"]["completion_tokens"] <= 2
    ((request, made),) = seen
    return request, made.sampling


def test_left_out_flags_reach_the_engine_as_none_and_take_the_model_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    request, sampling = run_generate(monkeypatch, capsys)
    assert request.temperature is None and request.top_k is None and request.repetition_penalty is None
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (0.6, 0.95, 20, 0.0)
    assert (sampling.repetition_penalty, sampling.presence_penalty, sampling.frequency_penalty) == (1.1, 0, 0)
    assert sampling.seed == 3


def test_given_flags_win_over_the_model_defaults(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    request, sampling = run_generate(
        monkeypatch, capsys, "--temperature", "0", "--top-k", "0", "--repetition-penalty", "1.0"
    )
    assert (request.temperature, request.top_k, request.repetition_penalty) == (0.0, 0, 1.0)
    assert (sampling.temperature, sampling.top_k, sampling.repetition_penalty) == (0.0, 0, 1.0)
    assert sampling.top_p == 0.95  # a flag not given still takes the config's value


def test_kernels_flag_reaches_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kernels reference` runs; `--kernels fast` on a CPU fails with one line naming what is missing."""
    assert main([*BASE, "--kernels", "reference"]) == 0
    capsys.readouterr()
    rc = main([*BASE, "--kernels", "fast"])
    _, err = capsys.readouterr()
    assert rc == 1 and "the fast kernels need a CUDA device" in err
