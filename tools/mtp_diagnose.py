"""Where MTP decoding parts from plain decoding: `python -m tools.mtp_diagnose [--device cuda]`.

Runs the same greedy requests plainly and with ``mtp:K`` under each Engine configuration of a matrix
(op table, CUDA graphs, decode lookahead, dtype) and prints one JSON line per (configuration, K): for
each request the first token where the two part (or -1), plain decoding's margin between its two best
tokens there, and the drafts accepted. A configuration whose fp32 run parts at a wide margin holds the
fault; the plain runs are also compared across configurations (the op tables' own near ties).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import time

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.cli.common import bundled_artifact

TEXTS = [
    "def fibonacci(n):\n    ",
    "import numpy as np\nimport",
    "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(",
    "with open(path) as f:\n",
    "x = [1, 2, 3]\ny = [",
]
CONFIGS = {
    "reference-eager": {"kernels": "reference", "cuda_graphs": False, "decode_lookahead": False},
    "fast-eager": {"kernels": "fast", "cuda_graphs": False, "decode_lookahead": False},
    "fast-graphs": {"kernels": "fast", "cuda_graphs": True, "decode_lookahead": False},
    "fast-graphs-lookahead": {"kernels": "fast", "cuda_graphs": True, "decode_lookahead": True},
}


def _run(
    artifact: str, device: str, dtype: str, speculative: str | None, fields: dict
) -> list[GenerationResult]:
    config = EngineConfig(
        device=device, dtype=dtype, max_concurrency=4, max_context=1024, prefix_cache=False,  # type: ignore[arg-type]
        speculative=speculative, **fields,
    )  # fmt: skip
    requests = [
        GenerationRequest(prompt=t, max_tokens=48, temperature=0.0, logprobs=True, top_logprobs=2)
        for t in TEXTS
    ]
    with Engine(artifact, config) as engine:
        handles = [engine.submit(r) for r in requests]
        return [h.result() for h in handles]


def parting(got: GenerationResult, want: GenerationResult) -> dict:
    """The first token where ``got`` leaves ``want`` and ``want``'s top-two margin there."""
    assert want.logprobs is not None
    for i, (a, b) in enumerate(zip(got.token_ids, want.token_ids)):
        if a != b:
            top = want.logprobs[i].top
            margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
            return {"at": i, "margin": round(margin, 4), "got": a, "want": b}
    return {"at": -1, "lengths": [len(got.token_ids), len(want.token_ids)]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--ks", default="1,3")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--dump-after", type=float, default=0, help="print every thread's stack after S seconds")
    args = p.parse_args()
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after, repeat=True)
    artifact = str(bundled_artifact())
    for dtype in args.dtypes.split(","):
        plains: dict[str, list[GenerationResult]] = {}
        for name in args.configs.split(","):
            fields = (
                CONFIGS[name] if args.device == "cuda" else {"kernels": "reference", "cuda_graphs": False}
            )
            try:
                plain = plains[name] = _run(artifact, args.device, dtype, None, fields)
                if len(plains) > 1:
                    first = next(iter(plains))
                    line = {"dtype": dtype, "plain": name, "against": first}
                    line["parts"] = [parting(a, b) for a, b in zip(plain, plains[first])]
                    print(json.dumps(line), flush=True)
                for k in (int(x) for x in args.ks.split(",")):
                    t0 = time.perf_counter()
                    mtp = _run(artifact, args.device, dtype, f"mtp:{k}", fields)
                    line = {
                        "dtype": dtype,
                        "config": name,
                        "k": k,
                        "seconds": round(time.perf_counter() - t0, 1),
                    }
                    line["parts"] = [parting(a, b) for a, b in zip(mtp, plain)]
                    line["accepted"] = [r.usage.accepted_draft_tokens for r in mtp]
                    line["drafted"] = [r.usage.drafted_tokens for r in mtp]
                    print(json.dumps(line), flush=True)
            except Exception as e:  # a configuration that fails says how and the others still run
                print(
                    json.dumps({"dtype": dtype, "config": name, "error": f"{type(e).__name__}: {e}"}),
                    flush=True,
                )


if __name__ == "__main__":
    main()
