"""The KV pool on `/metrics` (`ninfer_kv_pool_tokens`, from `Engine.capacity()`) and in the one line
`ninfer serve` prints when its Engine has started."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_helpers import ScriptProgram, metric, running_server, scripted_engine

from ninfer.cli.common import announce_capacity
from ninfer.targets.open import load_frontend


def test_metrics_and_the_start_line_say_the_pool(
    tiny_artifact: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    frontend = load_frontend(str(tiny_artifact))
    engine = scripted_engine(ScriptProgram(max_context=64, page_size=16, kv_pages=24), frontend)
    capacity = engine.capacity()
    assert (capacity.kv_pool_tokens, capacity.max_context, capacity.page_size) == (24 * 16, 64, 16)
    capsys.readouterr()
    assert announce_capacity(engine, "serve") is engine
    err = capsys.readouterr().err
    assert err == "ninfer serve: KV pool 384 tokens, max_context 64, up to 4 requests at once\n"
    with running_server(engine, frontend) as server:
        assert metric(server.url, "ninfer_kv_pool_tokens") == 384
