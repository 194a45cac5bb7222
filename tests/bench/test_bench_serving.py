"""The serving workload on CPU: `ninfer bench --server URL` against a real `ninfer serve` of the bundled demo
model (a subprocess on a free loopback port), the same workload through the in-process Engine
(`ninfer bench --concurrency`), and their comparison. Checked: the reports' structure, every request's
token count equal to max_tokens, that both runs draw the same prompts, that a failing stream stops the
others, that the client leaves no request running, and the flag checks. CPU times are noise: no time is
asserted."""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import ninfer
from ninfer.bench.drive import BenchError, PromptSource
from ninfer.bench.serving import (
    HttpServer,
    RequestTiming,
    ServingPlan,
    compare,
    drive,
    percentile,
    run_level,
    split_base_url,
)
from ninfer.bench.serving import main as serving_main
from ninfer.cli.main import main
from ninfer.version import version

PROMPT, TOKENS, REQUESTS = 16, 8, 2
WORKLOAD = ("--concurrency", "1,2", "--prompt-tokens", str(PROMPT), "--max-tokens", str(TOKENS))
WORKLOAD += ("--requests", str(REQUESTS))
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`ninfer serve` (the bundled demo model) in its own process, as on the device: loopback, a free port,
    the Engine settings the in-process run uses (max_concurrency 2, max_context prompt + max_tokens, the
    context cache off)."""
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    root = str(Path(ninfer.__file__).parents[1])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
    }
    command = [
        sys.executable, "-m", "ninfer", "serve", "--device", "cpu", "--port", str(port),
        "--max-concurrency", "2", "--max-context", str(PROMPT + TOKENS), "--prefix-cache", "off",
        "--log-level", "warning",
    ]  # fmt: skip
    with open(log, "w") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while status(url + "/ready") != 200:
            assert process.poll() is None, f"ninfer serve exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"not ready in {READY_TIMEOUT_S} s: {log.read_text()}"
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def bench(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", *args])
    return code, out.getvalue(), err.getvalue()


def bench_json(*args: str) -> dict[str, Any]:
    code, out, err = bench(*args, "--json")
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def http_report(server: str) -> dict[str, Any]:
    return bench_json("--server", server, *WORKLOAD)


@pytest.fixture(scope="module")
def engine_report() -> dict[str, Any]:
    return bench_json("--device", "cpu", *WORKLOAD)


def check_levels(report: dict[str, Any]) -> None:
    assert report["mode"] == "serving"
    assert report["settings"] == {
        "endpoint": "/v1/completions", "concurrency": [1, 2], "prompt_tokens": PROMPT, "max_tokens": TOKENS,
        "requests_per_stream": REQUESTS, "duration_s": None, "warmup_tokens": TOKENS,
    }  # fmt: skip
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        c = level["concurrency"]
        assert level["requests"] == c * REQUESTS == len(level["per_request"])
        assert level["completion_tokens"] == c * REQUESTS * TOKENS
        assert all(r["completion_tokens"] == TOKENS for r in level["per_request"])
        assert sorted(r["stream"] for r in level["per_request"]) == sorted(list(range(c)) * REQUESTS)
        assert level["output_tok_s"] > 0 and level["wall_s"] > 0
        for key in ("ttft_ms", "tpot_ms"):
            stats = level[key]
            assert 0 < stats["p50"] <= stats["p99"] <= stats["max"]
            assert min(r[key] for r in level["per_request"]) <= stats["mean"] <= stats["max"]
        assert level["itl_ms"]["p50"] <= level["itl_ms"]["p99"] <= level["itl_ms"]["max"]


def test_the_client_against_a_real_server(server: str, http_report: dict[str, Any]) -> None:
    assert http_report["target"] == "http" and http_report["model"] == "qwen3_6_demo"
    assert http_report["server"] == server and http_report["max_model_len"] == PROMPT + TOKENS
    assert http_report["server_version"] == version()
    check_levels(http_report)
    # the client left nothing running: the server's lanes are all free again
    with urllib.request.urlopen(server + "/metrics", timeout=5) as answer:
        metrics = answer.read().decode()
    active = [line for line in metrics.splitlines() if line.startswith("ninfer_active_lanes")]
    assert active and float(active[0].split()[-1]) == 0


def test_the_table(server: str) -> None:
    code, out, err = bench("--server", server, "--concurrency", "1", "--prompt-tokens", "4", "--max-tokens=2")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("ninfer bench serving (http)") and lines[2].split()[:2] == ["1", "4"]


def test_the_engine_run_and_the_comparison(
    engine_report: dict[str, Any], http_report: dict[str, Any], tmp_path: Path
) -> None:
    assert engine_report["target"] == "engine" and engine_report["package"] == "qwen3_6_demo"
    assert engine_report["engine"]["max_concurrency"] == 2
    assert engine_report["engine"]["max_context"] == PROMPT + TOKENS
    assert engine_report["engine"]["prefix_cache"] is False
    check_levels(engine_report)
    both = compare(engine_report, http_report)
    assert [row["concurrency"] for row in both["gateway"]] == [1, 2]
    for row in both["gateway"]:
        over, direct = row["http_ttft_ms_p50"], row["engine_ttft_ms_p50"]
        assert row["added_ttft_ms_p50"] == pytest.approx(over - direct, abs=2e-3)
        ratio = row["http_tpot_ms_p50"] / row["engine_tpot_ms_p50"]
        assert row["added_tpot_pct_p50"] == pytest.approx((ratio - 1) * 100, abs=0.02)
        assert isinstance(row["meets_target"], bool)
    assert both["engine"] is engine_report and both["http"] is http_report
    with pytest.raises(ValueError, match="Engine's report first"):
        compare(http_report, engine_report)
    with pytest.raises(ValueError, match="differ in seed"):
        compare(engine_report, {**http_report, "seed": 1})
    paths = [tmp_path / "engine.json", tmp_path / "http.json"]
    for path, report in zip(paths, (engine_report, http_report)):
        path.write_text(json.dumps(report))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert serving_main(["compare", *map(str, paths)]) == 0
    assert json.loads(out.getvalue())["gateway"] == both["gateway"]


class Recorder:
    """A fake target: records the prompts each stream sends; each request takes ``seconds`` (unless
    stopped); stream ``fail`` raises in its first request once ``others`` streams are in theirs."""

    def __init__(self, fail: int | None = None, seconds: float = 0.0, others: int = 0) -> None:
        self.sent: list[tuple[int, tuple[int, ...]]] = []
        self.fail = fail
        self.seconds = seconds
        self.others = threading.Semaphore(0)
        self.waiting_for = others
        self.stopped: list[int] = []
        self.lock = threading.Lock()

    def open_stream(self, index: int) -> Recorder.Stream:
        return Recorder.Stream(self, index)

    class Stream:
        def __init__(self, owner: Recorder, index: int) -> None:
            self.owner, self.index = owner, index

        def request(self, prompt: list[int], max_tokens: int, stop: threading.Event) -> RequestTiming:
            if self.index == self.owner.fail:
                for _ in range(self.owner.waiting_for):
                    assert self.owner.others.acquire(timeout=60)
                raise BenchError("stream failed")
            self.owner.others.release()
            deadline = time.monotonic() + self.owner.seconds
            while time.monotonic() < deadline:
                if stop.is_set():
                    with self.owner.lock:
                        self.owner.stopped.append(self.index)
                    raise BenchError("stopped")
                time.sleep(0.005)
            with self.owner.lock:
                self.owner.sent.append((self.index, tuple(prompt)))
            return RequestTiming(self.index, 0.01, 0.001, max_tokens, (0.001,))

        def close(self) -> None:
            pass


def test_both_targets_get_the_same_prompts() -> None:
    plan = ServingPlan(concurrency=(2, 1), prompt_tokens=5, max_tokens=3, requests_per_stream=2)
    runs = []
    for _ in range(2):
        target = Recorder()
        levels = drive(target, plan, PromptSource(100, seed=7), log=lambda _: None)
        assert [level.concurrency for level in levels] == [2, 1]
        assert [len(level.requests) for level in levels] == [4, 2]
        runs.append(sorted(target.sent))
    assert runs[0] == runs[1] and len(runs[0]) == 2 + 4 + 2  # warm-up (max C), then the levels
    assert len({prompt for _, prompt in runs[0]}) == len(runs[0])  # distinct prompts


def test_a_failing_stream_stops_the_others() -> None:
    target = Recorder(fail=0, seconds=60, others=2)
    with pytest.raises(BenchError, match="stream failed"):
        run_level(target, [[[1, 2]], [[3, 4]], [[5, 6]]], 2)
    assert sorted(target.stopped) == [1, 2] and not target.sent


def test_duration_bounds_a_level() -> None:
    target = Recorder(seconds=0.05)
    level = run_level(target, [[[1]] * 5, [[2]] * 5], 2, duration_s=0.01)
    assert len(level.requests) == 2  # each stream started one request before the bound, then stopped


def test_a_refused_request_fails_the_run(server: str) -> None:
    client = HttpServer(server)
    client.describe()
    stream = client.open_stream(0)
    try:
        with pytest.raises(BenchError, match="answered 400"):
            stream.request([10**7], 2, threading.Event())  # outside the vocabulary
    finally:
        stream.close()


def test_helpers() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
    assert percentile([4.0], 99) == 4.0
    assert split_base_url("http://127.0.0.1:8000/v1/") == ("http", "127.0.0.1", 8000, "")
    assert split_base_url("https://h/p") == ("https", "h", 443, "/p")
    with pytest.raises(ValueError, match="http"):
        split_base_url("127.0.0.1:8000")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--server", "http://127.0.0.1:9", "--batch", "2"], "--batch is not used by the serving workload"),
        (["--concurrency", "1", "--decode-steps", "5"], "--decode-steps is not used by the serving workload"),
        (["--server", "http://127.0.0.1:9", "--synthetic", "qwen3_6_tiny"], "configures an in-process"),
        (["--server", "http://127.0.0.1:9", "--device", "cpu"], "configures an in-process Engine"),
        (["--concurrency", "1", "--api-key", "k"], "--api-key is not used"),
        (["--server", "http://127.0.0.1:9", "--max-tokens", "1"], "--max-tokens must be >= 2"),
        (["--server", "ftp://example"], "http(s)://HOST"),
        (["--concurrency", "9", "--device", "cpu"], "at most 8 requests at once"),
    ],
)
def test_flag_checks(extra: list[str], message: str) -> None:
    code, _, err = bench(*extra)
    assert code == 1 and message in err, err


def test_an_unreachable_server() -> None:
    code, _, err = bench("--server", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and "cannot reach" in err


def test_bad_concurrency_lists() -> None:
    for value in ("0", "1,1", "a"):
        with pytest.raises(SystemExit) as exit_info, contextlib.redirect_stderr(io.StringIO()):
            main(["bench", "--concurrency", value])
        assert exit_info.value.code == 2


def test_the_request_and_a_broken_stream() -> None:
    """What the client sends (a raw socket reads it), and a stream cut off mid-chunk: a BenchError."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen: dict[str, bytes] = {}

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            head, body = data.split(b"\r\n\r\n", 1)
            fields = (line.split(b": ", 1) for line in head.split(b"\r\n")[1:])
            length = int({name.lower(): value for name, value in fields}[b"content-length"])
            while len(body) < length:
                body += conn.recv(65536)
            seen.update(head=head, body=body)
            conn.sendall(b'HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n40\r\ndata: {"choi')

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    client = HttpServer(f"http://127.0.0.1:{listener.getsockname()[1]}/v1", api_key="sk-test")
    client.model = "qwen3_6_demo"
    stream = client.open_stream(0)
    try:
        with pytest.raises(BenchError, match="IncompleteRead|RemoteDisconnected|Connection"):
            stream.request([5, 6, 7], 4, threading.Event())
    finally:
        stream.close()
        thread.join(10)
        listener.close()
    assert seen["head"].startswith(b"POST /v1/completions HTTP/1.1")
    assert b"Authorization: Bearer sk-test" in seen["head"]
    assert json.loads(seen["body"]) == {
        "model": "qwen3_6_demo", "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
