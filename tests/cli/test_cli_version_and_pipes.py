"""`ninfer --version`, and output cut short by its reader (`ninfer ... | head`) ending quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.cli.main import main, version

DEMO_ARTIFACT = Path(__file__).resolve().parents[2] / "ninfer/targets/qwen3_6_demo/qwen3_6_demo.ninfer"


def test_version_names_the_distribution(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    assert out == f"ninfer {version()}" and version()[0].isdigit()


def test_a_closed_pipe_is_not_a_traceback() -> None:
    """`ninfer inspect --json` into a pipe whose reader has gone: no traceback, status 141 (SIGPIPE's)."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE
    try:
        writer = subprocess.run(
            [sys.executable, "-m", "ninfer", "inspect", str(DEMO_ARTIFACT), "--json"],
            stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120,
        )  # fmt: skip
    finally:
        os.close(write_end)
    assert "Traceback" not in writer.stderr and "BrokenPipe" not in writer.stderr, writer.stderr
    assert writer.returncode == 141, writer.stderr
