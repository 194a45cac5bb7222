"""The serving workload: concurrent streams of fixed-length requests, timed as a client sees them.

``ninfer bench --server URL --concurrency 1,4,8`` sends the workload to a running ``ninfer serve`` over
HTTP (``vllm bench serve``'s role); ``ninfer bench [ARTIFACT | --synthetic PACKAGE] --concurrency 1,4,8``
runs the same workload through an in-process Engine, with no HTTP in between. Comparing the two
(``python -m ninfer.bench.serving compare ENGINE.json HTTP.json``) gives what the gateway adds to TTFT
and TPOT.

At each concurrency level C, C streams (threads) each send ``requests_per_stream`` requests back to back:
a token-id prompt of exactly ``prompt_tokens`` random ordinary ids (distinct per request, so no prefix
is shared; the same ids on both sides for the same seed), greedy, ``ignore_eos``, ``max_tokens``
tokens, streamed. Every request must end with ``length`` after exactly ``max_tokens`` tokens, or the
run fails. Per request: TTFT, from just before the request is sent to the first chunk with text (the
first a client can show), and TPOT, (end of generation - first text) / (tokens - 1), the end being the
chunk (event) that carries the finish reason. Per level: p50/p99 of both, inter-chunk gaps, and the
output tokens per second of the whole level (all tokens over first send to last finish).

The HTTP client is the standard library's ``http.client`` (one keep-alive connection per stream, no
dependency the device image lacks); a failing stream stops the others, whose connections close, so the
server cancels their requests.
"""

from __future__ import annotations

import http.client
import json
import math
import statistics
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from ninfer.bench.drive import BenchError, PromptSource

COMPLETIONS_PATH = "/v1/completions"
WARMUP_TOKENS = 16  # output tokens of each warm-up request (its prompt has the measured length)
JOIN_POLL_S = 0.2  # how often the main thread looks up from joining the streams (Ctrl-C stays prompt)
# the target for the gateway: at most this much added to the Engine's TTFT (ms) and TPOT (%)
TARGET_ADDED_TTFT_MS = 5.0
TARGET_ADDED_TPOT_PCT = 3.0


@dataclass(frozen=True)
class ServingPlan:
    concurrency: tuple[int, ...] = (1, 4, 8)  # streams at once, one level each, in this order
    prompt_tokens: int = 1024
    max_tokens: int = 128
    requests_per_stream: int = 4
    duration_s: float | None = None  # a stream starts no request this long after its level began
    request_timeout_s: float = 600.0  # the longest silence on a connection before the run fails

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be >= 1, got {self.concurrency}")
        if self.prompt_tokens < 1 or self.requests_per_stream < 1:
            raise ValueError("the serving workload needs prompts of >= 1 token and >= 1 request a stream")
        if self.max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2 (TPOT needs two tokens), got {self.max_tokens}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")

    @property
    def warmup_tokens(self) -> int:
        return min(WARMUP_TOKENS, self.max_tokens)

    @property
    def max_context(self) -> int:
        """Positions one request needs (the Engine's max_context, and the server's ``--max-context``)."""
        return self.prompt_tokens + self.max_tokens

    def settings(self) -> dict[str, Any]:
        return {
            "endpoint": COMPLETIONS_PATH,
            "concurrency": list(self.concurrency),
            "prompt_tokens": self.prompt_tokens,
            "max_tokens": self.max_tokens,
            "requests_per_stream": self.requests_per_stream,
            "duration_s": self.duration_s,
            "warmup_tokens": self.warmup_tokens,
        }


@dataclass(frozen=True)
class RequestTiming:
    stream: int
    ttft_s: float  # before sending -> the first chunk with text
    tpot_s: float  # (finish - first text) / (tokens - 1)
    completion_tokens: int
    gaps_s: tuple[float, ...]  # between consecutive chunks with text


class Arrivals:
    """The clock of one request: started at construction, then each text chunk and the finish."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.text: list[float] = []
        self.finish: float | None = None

    def saw_text(self) -> None:
        self.text.append(time.perf_counter())

    def finished(self) -> None:
        self.finish = time.perf_counter()

    def timing(self, stream: int, finish_reason: str | None, tokens: int, expected: int) -> RequestTiming:
        if finish_reason != "length" or tokens != expected:
            raise BenchError(
                f"a request ended with {finish_reason!r} after {tokens} tokens, {expected} expected "
                "(ignore_eos and max_tokens should fix the length)"
            )
        if not self.text or self.finish is None:
            raise BenchError("a request streamed no text or no finish")
        first = self.text[0]
        return RequestTiming(
            stream=stream,
            ttft_s=first - self.start,
            tpot_s=(self.finish - first) / (tokens - 1),
            completion_tokens=tokens,
            gaps_s=tuple(b - a for a, b in zip(self.text, self.text[1:])),
        )


class Stream(Protocol):
    """One client stream: requests one after another (one connection, or one caller thread)."""

    def request(self, prompt: list[int], max_tokens: int, stop: threading.Event) -> RequestTiming: ...

    def close(self) -> None: ...


class Target(Protocol):
    """Where the workload goes: a server over HTTP, or an Engine in this process."""

    def open_stream(self, index: int) -> Stream: ...


# ---- HTTP ----


def split_base_url(url: str) -> tuple[str, str, int, str]:
    """``http://host:port[/prefix]`` -> (scheme, host, port, path prefix); an OpenAI-style base URL
    ending in ``/v1`` is taken without it. ValueError for anything else."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--server needs an http(s)://HOST[:PORT] URL, got {url!r}")
    prefix = parts.path.rstrip("/").removesuffix("/v1")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.scheme, parts.hostname, port, prefix


class HttpServer:
    """A running OpenAI-compatible server that takes token-id prompts and ``ignore_eos`` (``ninfer
    serve``, vLLM, SGLang)."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        self.scheme, self.host, self.port, self.prefix = split_base_url(url)
        self.url = f"{self.scheme}://{self.host}:{self.port}{self.prefix}"
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.model = ""

    def connect(self) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=self.timeout_s)

    def get_json(self, path: str) -> tuple[int, Any]:
        conn = self.connect()
        try:
            conn.request("GET", self.prefix + path, headers=self.headers)
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        try:
            return response.status, json.loads(body)
        except ValueError:
            return response.status, body.decode(errors="replace")

    def describe(self) -> dict[str, Any]:
        """Checks the server is ready and names its model (the first it lists); returns what the report
        says about it. BenchError when it is not ready or lists no model."""
        try:
            status, ready = self.get_json("/ready")
            if status != 200:
                raise BenchError(f"{self.url}/ready answered {status}: {ready}; wait for it to be ready")
            status, models = self.get_json("/v1/models")
            _, version = self.get_json("/version")
        except OSError as e:
            raise BenchError(f"cannot reach {self.url}: {e}") from None
        if status != 200 or not isinstance(models, dict) or not models.get("data"):
            raise BenchError(f"{self.url}/v1/models answered {status}: {models}")
        card = models["data"][0]
        self.model = str(card["id"])
        return {
            "server": self.url,
            "model": self.model,
            "max_model_len": card.get("max_model_len"),
            "server_version": version.get("version") if isinstance(version, dict) else None,
        }

    def open_stream(self, index: int) -> HttpStream:
        return HttpStream(self, index)


class HttpStream:
    def __init__(self, server: HttpServer, index: int) -> None:
        self.server = server
        self.index = index
        self.conn: http.client.HTTPConnection | None = None

    def request(self, prompt: list[int], max_tokens: int, stop: threading.Event) -> RequestTiming:
        body = {
            "model": self.server.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payload = json.dumps(body).encode()
        try:
            return self._stream(payload, max_tokens, stop)
        except (http.client.HTTPException, OSError) as e:  # a broken or silent connection, named
            raise BenchError(f"{self.server.url}{COMPLETIONS_PATH}: {type(e).__name__}: {e}") from e

    def _stream(self, payload: bytes, max_tokens: int, stop: threading.Event) -> RequestTiming:
        clock, response = self._send(payload)
        if response.status != 200:
            detail = response.read().decode(errors="replace")
            raise BenchError(f"{COMPLETIONS_PATH} answered {response.status}: {detail[:500]}")
        finish: str | None = None
        tokens = 0
        for line in response:
            if stop.is_set():  # another stream failed: drop this one (the server cancels it)
                self.close()
                raise BenchError("stopped")
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"the stream carried an error: {event['error']}")
            for choice in event.get("choices", ()):
                if choice.get("text") or choice.get("reasoning_content"):
                    clock.saw_text()
                if choice.get("finish_reason") is not None:
                    finish = choice["finish_reason"]
                    clock.finished()
            if event.get("usage"):
                tokens = int(event["usage"]["completion_tokens"])
        response.read()  # the rest of the chunked body, so the connection can carry the next request
        return clock.timing(self.index, finish, tokens, max_tokens)

    def _send(self, payload: bytes) -> tuple[Arrivals, http.client.HTTPResponse]:
        """POST the request (its clock starts just before); a kept-alive connection the server has
        closed meanwhile is replaced once, with a fresh clock."""
        for attempt in (0, 1):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = self.server.connect()
            clock = Arrivals()
            try:
                self.conn.request(
                    "POST", self.server.prefix + COMPLETIONS_PATH, body=payload, headers=self.server.headers
                )
                return clock, self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if not reused or attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# ---- in-process Engine ----


class EngineTarget:
    """The same requests through ``Engine.submit``: what the gateway itself calls, minus HTTP."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def open_stream(self, index: int) -> EngineStream:
        return EngineStream(self.engine, index)


class EngineStream:
    def __init__(self, engine: Any, index: int) -> None:
        self.engine = engine
        self.index = index

    def request(self, prompt: list[int], max_tokens: int, stop: threading.Event) -> RequestTiming:
        from ninfer.bench.drive import greedy_request
        from ninfer.types import GenerationDelta, GenerationResult

        request = greedy_request(prompt, max_tokens)
        clock = Arrivals()
        with self.engine.submit(request) as handle:
            for event in handle:
                if stop.is_set():
                    raise BenchError("stopped")  # leaving the block cancels the request
                if isinstance(event, GenerationDelta):
                    if event.text or event.reasoning_text:  # what the gateway would send as a chunk
                        clock.saw_text()
                elif isinstance(event, GenerationResult):
                    clock.finished()
            result = handle.result(raise_on_error=False)
        if result.error is not None:
            raise BenchError(f"request {result.request_id} failed: {result.error}")
        return clock.timing(self.index, result.finish_reason, result.usage.completion_tokens, max_tokens)

    def close(self) -> None:
        pass


# ---- levels ----


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of nothing")
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _ms(values_s: Sequence[float], keys: Sequence[str] = ("mean", "p50", "p99", "max")) -> dict[str, Any]:
    if not values_s:
        return dict.fromkeys(keys)
    stats = {
        "mean": statistics.fmean(values_s),
        "p50": percentile(values_s, 50),
        "p99": percentile(values_s, 99),
        "max": max(values_s),
    }
    return {k: round(stats[k] * 1e3, 3) for k in keys}


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    wall_s: float  # the level's first send -> its last finish
    requests: tuple[RequestTiming, ...]

    @property
    def completion_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.requests)

    def to_json(self) -> dict[str, Any]:
        gaps = [g for r in self.requests for g in r.gaps_s]
        return {
            "concurrency": self.concurrency,
            "requests": len(self.requests),
            "completion_tokens": self.completion_tokens,
            "wall_s": round(self.wall_s, 4),
            "output_tok_s": round(self.completion_tokens / self.wall_s, 2) if self.wall_s > 0 else None,
            "ttft_ms": _ms([r.ttft_s for r in self.requests]),
            "tpot_ms": _ms([r.tpot_s for r in self.requests]),
            "itl_ms": _ms(gaps, ("p50", "p99", "max")),
            "per_request": [
                {
                    "stream": r.stream,
                    "ttft_ms": round(r.ttft_s * 1e3, 3),
                    "tpot_ms": round(r.tpot_s * 1e3, 3),
                    "completion_tokens": r.completion_tokens,
                }
                for r in self.requests
            ],
        }


def run_level(
    target: Target,
    prompts: Sequence[Sequence[list[int]]],
    max_tokens: int,
    duration_s: float | None = None,
) -> LevelResult:
    """``len(prompts)`` streams at once, stream i sending ``prompts[i]`` one after another. The first
    failure stops every stream (their requests are cancelled) and is raised once all have ended."""
    stop = threading.Event()
    results: list[list[RequestTiming]] = [[] for _ in prompts]
    errors: list[BaseException] = []
    start = time.perf_counter()
    deadline = None if duration_s is None else start + duration_s

    def stream(i: int) -> None:
        client = target.open_stream(i)
        try:
            for prompt in prompts[i]:
                if stop.is_set() or (deadline is not None and time.perf_counter() > deadline):
                    return
                results[i].append(client.request(prompt, max_tokens, stop))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            if not stop.is_set():
                errors.append(e)
            stop.set()
        finally:
            client.close()

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(JOIN_POLL_S)
    except KeyboardInterrupt:
        stop.set()
        for thread in threads:
            thread.join(30)
        raise
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return LevelResult(len(prompts), wall, tuple(t for per_stream in results for t in per_stream))


@dataclass(frozen=True)
class ServingReport:
    target: str  # "http" or "engine"
    header: dict[str, Any]  # what ran: the server, or the Engine's package, device and probes
    plan: ServingPlan
    levels: tuple[LevelResult, ...]
    engine: dict[str, Any] = field(default_factory=dict)  # the in-process Engine's settings

    def to_json(self) -> dict[str, Any]:
        out = {**self.header, "mode": "serving", "target": self.target, "settings": self.plan.settings()}
        if self.engine:
            out["engine"] = self.engine
        out["levels"] = [level.to_json() for level in self.levels]
        return out


def drive(
    target: Target, plan: ServingPlan, prompts: PromptSource, log: Callable[[str], None]
) -> tuple[LevelResult, ...]:
    """The warm-up (max(C) streams, one short request each, untimed), then one level per C. Prompts are
    drawn in a fixed order whatever ``duration_s`` cuts, so both targets see the same ids."""
    widest = max(plan.concurrency)
    log(f"warm-up: {widest} streams x one {plan.prompt_tokens}-token prompt, {plan.warmup_tokens} tokens")
    run_level(target, [[prompts.take(plan.prompt_tokens)] for _ in range(widest)], plan.warmup_tokens)
    levels = []
    for c in plan.concurrency:
        per_stream = [
            [prompts.take(plan.prompt_tokens) for _ in range(plan.requests_per_stream)] for _ in range(c)
        ]
        log(
            f"{c} stream(s) x {plan.requests_per_stream} requests of {plan.prompt_tokens} + "
            f"{plan.max_tokens} tokens"
        )
        levels.append(run_level(target, per_stream, plan.max_tokens, plan.duration_s))
    return tuple(levels)


def prompt_source(package_name: str, seed: int) -> PromptSource:
    """Random ordinary ids of a registered package (below its first special id), as the bench draws."""
    from ninfer.bench.runner import first_special_id
    from ninfer.targets.registry import get_package

    return PromptSource(first_special_id(get_package(package_name).variant.special), seed)


def run_http(
    server: HttpServer, plan: ServingPlan, seed: int, log: Callable[[str], None] = lambda _: None
) -> ServingReport:
    """The workload against ``server``. Its model name must be a registered package's (``ninfer serve``'s
    default), which says which ids are ordinary tokens."""
    from ninfer.bench.report import git_commit
    from ninfer.targets.registry import PackageMismatch

    described = server.describe()
    limit = described.get("max_model_len")
    if isinstance(limit, int) and plan.max_context > limit:
        raise BenchError(
            f"prompt + max_tokens = {plan.max_context} exceeds the server's max_model_len {limit}"
        )
    try:
        prompts = prompt_source(server.model, seed)
    except (KeyError, ValueError, PackageMismatch) as e:
        raise BenchError(
            f"the server's model {server.model!r} is no registered package ({e}); serve it under its "
            "package name (ninfer serve's default) so the client knows its ordinary token ids"
        ) from None
    header = {
        **described,
        "client_commit": git_commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "seed": seed,
    }
    log(f"{server.url}: {server.model}")
    return ServingReport("http", header, plan, drive(server, plan, prompts, log))


def run_engine(
    options: Any,
    plan: ServingPlan,
    log: Callable[[str], None] = lambda _: None,
    on_start: Callable[[Any], None] | None = None,
) -> ServingReport:
    """The workload through an in-process Engine started from ``options`` (a `BenchOptions`), configured
    as ``ninfer serve --max-concurrency max(C) --max-context prompt+max_tokens`` would be. ``on_start``
    sees the started Engine before the first request (a diagnostic tool's observer goes on there)."""
    from ninfer.bench.runner import engine_config, options_package, probe_and_start, run_header

    package, _ = options_package(options)
    positions = package.variant.max_position_embeddings
    if plan.max_context > positions:
        raise ValueError(
            f"prompt + max_tokens = {plan.max_context} exceeds the model's {positions} positions"
        )
    widest = max(plan.concurrency)
    config = replace(
        engine_config(options), max_concurrency=widest, queue_capacity=widest, max_context=plan.max_context
    )
    probe, started = probe_and_start(options, config, log)
    try:
        if on_start is not None:
            on_start(started.engine)
        prompts = prompt_source(package.name, options.seed)
        levels = drive(EngineTarget(started.engine), plan, prompts, log)
        engine = started.engine.config
        settings = {
            "max_concurrency": engine.max_concurrency,
            "max_context": engine.max_context,
            "prefix_cache": engine.prefix_cache,
            "kernels": engine.kernels,
            "cuda_graphs": engine.cuda_graphs,
            "decode_lookahead": engine.decode_lookahead,
            "speculative": engine.speculative,
        }
    finally:
        started.engine.close()
    header = {**run_header(started, probe).to_json(), "seed": options.seed}
    return ServingReport("engine", header, plan, levels, engine=settings)


# ---- the gateway's share ----


def _levels(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {level["concurrency"]: level for level in report["levels"]}


def compare(engine: dict[str, Any], http: dict[str, Any]) -> dict[str, Any]:
    """What HTTP adds, per concurrency level both reports hold: TTFT in ms and TPOT in % of the Engine's
    (p50 and mean), throughput beside each other, and whether the issue's target holds (p50s). The two
    runs must be the same workload (settings and seed)."""
    for key in ("settings", "seed"):
        if engine.get(key) != http.get(key):
            raise ValueError(f"the two runs differ in {key}: {engine.get(key)} vs {http.get(key)}")
    if (engine.get("target"), http.get("target")) != ("engine", "http"):
        raise ValueError("give the Engine's report first, then the server's")
    rows = []
    served = _levels(http)
    for c, direct in _levels(engine).items():
        if c not in served:
            continue
        over = served[c]
        row: dict[str, Any] = {"concurrency": c}
        for stat in ("p50", "mean"):
            row[f"added_ttft_ms_{stat}"] = round(over["ttft_ms"][stat] - direct["ttft_ms"][stat], 3)
            row[f"added_tpot_pct_{stat}"] = round(
                (over["tpot_ms"][stat] / direct["tpot_ms"][stat] - 1) * 100, 2
            )
        row.update(
            engine_ttft_ms_p50=direct["ttft_ms"]["p50"],
            http_ttft_ms_p50=over["ttft_ms"]["p50"],
            engine_tpot_ms_p50=direct["tpot_ms"]["p50"],
            http_tpot_ms_p50=over["tpot_ms"]["p50"],
            engine_output_tok_s=direct["output_tok_s"],
            http_output_tok_s=over["output_tok_s"],
        )
        row["meets_target"] = (
            row["added_ttft_ms_p50"] <= TARGET_ADDED_TTFT_MS
            and row["added_tpot_pct_p50"] <= TARGET_ADDED_TPOT_PCT
        )
        rows.append(row)
    return {
        "mode": "serving_comparison",
        "target": {"added_ttft_ms": TARGET_ADDED_TTFT_MS, "added_tpot_pct": TARGET_ADDED_TPOT_PCT},
        "gateway": rows,
        "engine": engine,
        "http": http,
    }


def render(report: ServingReport) -> str:
    head = report.header
    where = head.get("server") or f"{head.get('package')} in-process on {head.get('device')}"
    plan = report.plan
    lines = [
        f"ninfer bench serving ({report.target}): {where}; {plan.prompt_tokens}-token prompts, "
        f"{plan.max_tokens} tokens each, {plan.requests_per_stream} requests a stream",
        f"{'C':>3} {'reqs':>5} {'tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} "
        f"{'ITL p99':>8}",
    ]
    for level in report.levels:
        j = level.to_json()
        ttft, tpot, itl = j["ttft_ms"], j["tpot_ms"], j["itl_ms"]
        lines.append(
            f"{level.concurrency:>3} {j['requests']:>5} {j['output_tok_s'] or 0:>9.1f} {ttft['p50']:>9.2f} "
            f"{ttft['p99']:>9.2f} {tpot['p50']:>9.3f} {tpot['p99']:>9.3f} {itl['p99'] or 0:>8.2f}"
        )
    lines.append("times in ms; TTFT: send -> first text chunk; TPOT: (finish - first text) / (tokens - 1)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ninfer.bench.serving compare ENGINE.json HTTP.json``: the gateway's share, as JSON."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "compare":
        print("usage: python -m ninfer.bench.serving compare ENGINE.json HTTP.json", file=sys.stderr)
        return 2
    with open(args[1]) as f_engine, open(args[2]) as f_http:
        engine, http_report = json.load(f_engine), json.load(f_http)
    try:
        print(json.dumps(compare(engine, http_report)))
    except (KeyError, ValueError) as e:
        print(f"ninfer.bench.serving: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
