"""`ninfer bench --context N,N...`: the long-context decode, and --prefill-tokens up to the model's positions.

A real run on the bundled demo model (CPU, contexts 256 and 512, B = 1 and 2): every (N, B) row's B rows
continued the shared prompt's checkpoint at N (reused_prefix_tokens), its floor is the weights plus the
K/V and GDN state bytes computed here by hand from the package's dims, and a (N, B) the fit check refuses
is reported as skipped instead of run. The prompt placement, the capture interval, the fit check and the
prefill clamp are pure arithmetic, checked at the real 27B's dims.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from argparse import Namespace
from typing import Any

import pytest
import torch

import ninfer.bench.context as context_module
from ninfer.bench.context import LongContextPlan, SharedPrompt, capture_interval, fit_problem
from ninfer.bench.drive import BenchPlan
from ninfer.bench.roofline import decode_step_bytes, prefill_flops
from ninfer.cli.main import main
from ninfer.runtime.engine.engine import EngineCapacity
from ninfer.targets.registry import get_package

torch.set_num_threads(1)
CONTEXTS = (256, 512)
BATCHES = (1, 2)
REFUSED = (512, 2)  # the run's fit check refuses this one (the CPU pool holds every (N, B) by construction)
ARGS = (
    "bench", "--context", "256,512", "--batch", "1,2", "--decode-steps", "4", "--prefill-tokens", "128",
    "--prefill-repeats", "1", "--device", "cpu", "--json",
)  # fmt: skip
FP32 = 4


@pytest.fixture(scope="module")
def long_report() -> tuple[dict[str, Any], str]:
    real = context_module.fit_problem

    def refusing(prompt: SharedPrompt, batch: int, max_tokens: int, capacity: EngineCapacity) -> str | None:
        if (prompt.context, batch) == REFUSED:
            return "refused by the test"
        return real(prompt, batch, max_tokens, capacity)

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(context_module, "fit_problem", refusing)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(list(ARGS))
    assert rc == 0, err.getvalue()
    return json.loads(out.getvalue()), err.getvalue()


def test_every_row_continued_the_shared_prompt(long_report: tuple[dict[str, Any], str]) -> None:
    report, err = long_report
    rows = report["decode"]
    ran = [(n, b) for n in CONTEXTS for b in BATCHES if (n, b) != REFUSED]
    assert [(r["context"], r["batch"]) for r in rows] == ran
    for row in rows:
        n, b = row["context"], row["batch"]
        assert row["frontier"] == n and row["prompt_tokens"] == n + 1  # one token past the capture
        assert row["reused_prefix_tokens"] == [n] * b and row["reused"] is True
        assert row["steps"] == 4 and 0 < row["ms_step_min"] <= row["ms_step"] <= row["ms_step_max"]
    assert report["decode_skipped"] == [{"context": 512, "batch": 2, "reason": "refused by the test"}]
    assert "context 512 B=2 skipped: refused by the test" in err
    assert "context 512: primed (it reused 256 tokens)" in err  # the prompts chain: 512 continues 256
    s = report["settings"]
    assert s["contexts"] == list(CONTEXTS) and s["shared_prompts"] is True and s["prefix_cache"] is True
    assert s["capture_interval"] == 256 and s["kv_pool_tokens"] > 0 and s["engine_max_context"] > 513
    assert any(a.startswith("long-context floor") for a in report["assumptions"])


def test_floor_is_weights_plus_kv_plus_state_read_and_written(
    long_report: tuple[dict[str, Any], str],
) -> None:
    """By hand from the demo's dims (fp32 on CPU): K and V per position in every attention layer, the
    GDN recurrent and conv state twice (read, written); the weights as the standard roofline reads them."""
    report, _ = long_report
    v = get_package("qwen3_6_demo").variant
    kv_per_position = len(v.attention_layers) * 2 * v.num_kv_heads * v.head_dim * FP32
    recurrent = v.linear_num_value_heads * v.linear_key_head_dim * v.linear_value_head_dim * FP32
    conv = v.conv_dim * (v.linear_conv_kernel_dim - 1) * FP32
    state_per_row = len(v.gdn_layers) * (recurrent + conv)
    bandwidth = report["bandwidth_GBps"] * 1e9
    for row in report["decode"]:
        b, positions = row["batch"], row["prompt_tokens"]
        cold = decode_step_bytes(v, b, 0, torch.float32)
        kv = b * positions * kv_per_position
        assert row["kv_bytes_step"] == kv and math.isclose(row["kv_GB_step"], kv / 1e9, abs_tol=1e-4)
        assert row["state_bytes_step"] == 2 * b * state_per_row
        assert row["bytes_step"] == cold.weights + cold.embedding_rows + kv + 2 * b * state_per_row
        assert math.isclose(row["floor_ms"], row["bytes_step"] / bandwidth * 1e3, rel_tol=1e-3)
        assert math.isclose(row["pct_floor"], 100 * row["floor_ms"] / row["ms_step"], rel_tol=2e-3)


def test_prefill_flops_are_reported_by_part(long_report: tuple[dict[str, Any], str]) -> None:
    report, _ = long_report
    p = report["prefill"]
    count = prefill_flops(get_package("qwen3_6_demo").variant, 128)
    assert (p["flops_linear"], p["flops_attention"], p["flops_recurrence"]) == (
        count.linear, count.attention, count.recurrence,
    )  # fmt: skip
    assert p["flops"] == count.total and p["output_tokens"] == 5  # decode_steps + 1


def test_27b_prefill_at_the_model_positions_counts_causal_attention() -> None:
    """2 x 2 x n^2/2 x heads x head_dim per attention layer (QK^T and PV over the causal pairs; the
    count takes n(n+1)/2 pairs, the diagonal included)."""
    v = get_package("qwen3_6_27b").variant
    n = 262144
    pairs = n * (n + 1) // 2
    assert (
        prefill_flops(v, n).attention
        == len(v.attention_layers) * 2 * 2 * pairs * v.num_attention_heads * v.head_dim
    )
    assert prefill_flops(v, n).attention > prefill_flops(v, n).linear  # attention dominates at 256k


def test_capture_interval_lands_a_capture_on_every_context() -> None:
    assert capture_interval((32768, 131072, 262144)) == 4096  # the Engine's default divides them all
    assert capture_interval((256, 512)) == 256
    assert capture_interval((6000,)) == 3000  # the largest divisor up to 4096
    assert capture_interval((1000, 1001)) == 512  # no common divisor >= 64: a power of two below 1000


def test_27b_prompts_end_one_token_past_their_capture_within_the_model_positions() -> None:
    positions = get_package("qwen3_6_27b").variant.max_position_embeddings
    plan = BenchPlan(
        batches=(1, 8), context=262144, decode_steps=16, prefill_tokens=131072, prefill_repeats=1,
        prefill_chunk=8192, contexts=(32768, 131072, 262144),
    )  # fmt: skip
    long_plan = LongContextPlan.build(plan, positions)
    assert long_plan.interval == 4096
    got = [(p.context, p.prompt_tokens, p.frontier) for p in long_plan.prompts]
    assert got == [(32768, 32769, 32768), (131072, 131073, 131072), (262144, 258049, 258048)]
    budget = long_plan.budget(8, long_plan.prompts[-1])
    assert budget == 1 + 17 + 7 + 8  # first token, steps + 1 rounds, one per later row, slack
    assert long_plan.max_context <= positions
    assert all(p.prompt_tokens + long_plan.budget(8, p) <= positions for p in long_plan.prompts)
    with pytest.raises(ValueError, match="exceeds the model's 262144 positions"):
        LongContextPlan.build(BenchPlan((1,), 1, 4, 1, 1, 8192, contexts=(300000,)), positions)


def test_fit_check_counts_the_shared_prefix_once() -> None:
    """27B on an H200 (the sizing doc's pool: 815,744 tokens at 64 positions a page): eight rows at
    258k fit when they share the prefix; a pool one 256k request fills does not hold the rows' growth."""
    page_bytes = 64 * 65536  # 64 KiB a position
    prompt = SharedPrompt(262144, 258049, 258048)

    def capacity(tokens: int, max_context: int = 262144) -> EngineCapacity:
        return EngineCapacity(max_context, 8, tokens, tokens // 64 * page_bytes, 64, 0.9, "")

    assert fit_problem(prompt, 8, 33, capacity(815744)) is None
    problem = fit_problem(prompt, 8, 33, capacity(258048 + 4 * 64))
    assert problem is not None and "8 rows sharing a 258048-token prefix need 4040 KV pages" in problem
    short = fit_problem(prompt, 1, 33, capacity(815744, max_context=200000))
    assert short is not None and "max_context is 200000" in short


def test_prefill_tokens_up_to_the_model_positions() -> None:
    from ninfer.cli.bench import _prefill_output_tokens, _prefill_tokens

    args = Namespace(prefill_tokens=262144, decode_steps=64)
    assert _prefill_tokens(args, 262144) == 262142  # room for the first token and one TPOT interval
    assert _prefill_output_tokens(args, 262142, 262144) == 2
    assert _prefill_output_tokens(args, 262000, 262144) is None  # decode_steps + 1 fit
    assert _prefill_output_tokens(args, 262100, 262144) == 44
    plan = BenchPlan((1,), 2048, 64, 262142, 1, 8192, prefill_output_tokens=2)
    assert plan.max_context == 262144 and plan.prefill_max_tokens == 2


def test_long_context_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert main(["bench", "--context", "256,512", "--prefix-cache", "off", "--device", "cpu"]) == 1
    assert "drop --prefix-cache off" in capsys.readouterr().err
    assert main(["bench", "--multi-turn", "2", "--context", "32,64", "--device", "cpu"]) == 1
    assert "--context takes one value with --multi-turn" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--context", "256,0"])
