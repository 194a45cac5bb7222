"""Replay the hostile set (``hostile_cases.py``) against a server in another process while a prober times
``GET /health`` every 50 ms; print the unloaded and loaded latencies. A measurement, not a test: run

    python tests/serve/hostile_probe.py [--max-context N]

from the repository root (the server runs the scripted Program behind the real Qwen3.6 Frontend).
``--max-context 262144`` makes the 10 MiB prompts pass the byte bound, so they are tokenized in full.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]


def serve(max_context: int) -> None:
    """The server process: prints its URL, then serves until killed."""
    import tempfile

    from serve_helpers import ScriptProgram, running_server, scripted_engine
    from tiny_artifacts import write_tiny_artifact

    from ninfer.targets.open import load_frontend

    path = write_tiny_artifact("qwen3_6_tiny", Path(tempfile.mkdtemp()) / "tiny.ninfer")
    frontend = load_frontend(str(path))
    program = ScriptProgram(max_concurrency=2, max_context=max_context, page_size=64, kv_pages=8192)
    engine = scripted_engine(program, frontend, max_concurrency=2, queue_capacity=8)
    with running_server(engine, frontend) as server:
        print(server.url, flush=True)
        time.sleep(3600)


def probe(url: str, stop: Any, out: Any) -> None:
    """The prober process (apart from the client, whose body building would hold its GIL): /health
    latencies until ``stop`` is set, then the list on ``out``."""
    samples = []
    with httpx.Client(base_url=url, timeout=600) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get("/health")
            samples.append(time.perf_counter() - start)
            time.sleep(0.05)
    out.put(samples)


def timed_health(url: str, during: Callable[[], None]) -> list[float]:
    stop, out = multiprocessing.Event(), multiprocessing.Queue()
    prober = multiprocessing.Process(target=probe, args=(url, stop, out))
    prober.start()
    try:
        during()
    finally:
        stop.set()
    samples = out.get()
    prober.join()
    return samples


def slowloris(url: str, senders: int, stop: threading.Event) -> None:
    """Connections that send a header byte every 100 ms (the server closes them at its deadline)."""
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(senders)]
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n" * 100
    for byte in head:
        if stop.is_set():
            break
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.send(bytes([byte]))
        time.sleep(0.1)
    for sock in socks:
        sock.close()


def summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "median_ms": round(1e3 * statistics.median(ordered), 1),
        "p99_ms": round(1e3 * ordered[int(0.99 * (len(ordered) - 1))], 1),
        "max_ms": round(1e3 * ordered[-1], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-context", type=int, default=256)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.max_context)
        return
    from hostile_cases import hostile_cases

    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--max-context", str(args.max_context)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        url = server.stdout.readline().strip()
        idle = timed_health(url, lambda: time.sleep(5))
        statuses: dict[str, int] = {}

        def replay() -> None:
            stop = threading.Event()
            loris = threading.Thread(target=slowloris, args=(url, 50, stop))
            loris.start()
            with httpx.Client(base_url=url, timeout=600) as client:
                for case in hostile_cases():
                    statuses[case.name] = client.post(
                        case.path, content=case.body(), headers={"content-type": "application/json"}
                    ).status_code
            stop.set()
            loris.join()

        started = time.perf_counter()
        loaded = timed_health(url, replay)
        elapsed = time.perf_counter() - started
        report = {
            "max_context": args.max_context,
            "cases": len(statuses),
            "5xx": [name for name, status in statuses.items() if status >= 500],
            "replay_s": round(elapsed, 1),
            "health_unloaded": summary(idle),
            "health_during_hostile_set": summary(loaded),
        }
        print(json.dumps(report, indent=2))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
