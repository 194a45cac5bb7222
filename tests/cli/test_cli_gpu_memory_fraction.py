"""`--gpu-memory-fraction` on `serve`, `generate`, `chat` and `bench`: a value outside (0, 1] is a one-line
error (exit 2), a good one reaches EngineConfig.gpu_memory_fraction, and leaving it out keeps the
Engine's default (0.9)."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from ninfer import EngineConfig
from ninfer.bench.drive import BenchPlan
from ninfer.bench.runner import BenchOptions, engine_config
from ninfer.cli import serve as serve_cmd
from ninfer.cli.common import interactive_engine_config, with_memory_flag
from ninfer.cli.main import build_parser, main

COMMANDS = {
    "serve": ("serve", "--port", "1"),
    "generate": ("generate", "hi", "--device", "cpu"),
    "chat": ("chat", "--device", "cpu"),
    "bench": ("bench", "--synthetic", "qwen3_6_tiny", "--device", "cpu"),
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("value", ["0", "1.5", "-0.1", "most", "nan"])
def test_bad_fractions_are_one_line_exit_2(
    command: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    try:
        rc = main([*COMMANDS[command], "--gpu-memory-fraction", value])
    except SystemExit as exc:
        rc = int(exc.code or 0)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"argument --gpu-memory-fraction: expected a fraction in (0, 1], got '{value}'" in lines[0]


def parse(command: str, *flags: str) -> Any:
    positional = {"generate": ("hi",), "chat": (), "serve": (), "bench": ()}[command]
    return build_parser(only=command).parse_args([command, *positional, *flags])


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_the_fraction_reaches_the_engine_config(command: str) -> None:
    def config(*flags: str) -> EngineConfig:
        args = parse(command, *flags)
        if command == "serve":
            return with_memory_flag(serve_cmd.engine_config(args), args)  # as `run` builds it
        return interactive_engine_config(args)

    assert config().gpu_memory_fraction == 0.9
    assert config("--gpu-memory-fraction", "0.75").gpu_memory_fraction == 0.75
    assert config("--gpu-memory-fraction", "1").gpu_memory_fraction == 1.0


def test_bench_passes_the_fraction_to_its_engine() -> None:
    assert parse("bench", "--gpu-memory-fraction", "0.8").gpu_memory_fraction == 0.8
    plan = BenchPlan(batches=(1,), context=16, decode_steps=2, prefill_tokens=16, prefill_repeats=1,
                     prefill_chunk=16)  # fmt: skip
    options = BenchOptions(plan=plan, synthetic="qwen3_6_tiny", gpu_memory_fraction=0.8)
    assert engine_config(options).gpu_memory_fraction == 0.8
    assert engine_config(BenchOptions(plan=plan, synthetic="qwen3_6_tiny")).gpu_memory_fraction == 0.9


def test_engine_config_refuses_a_fraction_outside_0_1() -> None:
    for bad in (0.0, 1.01, -1.0):
        with pytest.raises(ValueError, match="gpu_memory_fraction must be in"):
            EngineConfig(gpu_memory_fraction=bad)
    assert sys.modules["ninfer"].EngineConfig().gpu_memory_fraction == 0.9
