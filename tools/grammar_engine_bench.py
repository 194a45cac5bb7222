"""Measure a grammar engine (llguidance or xgrammar) on this CPU with a real tokenizer.

    python tools/grammar_engine_bench.py llguidance [--tokenizer PATH] [--json]
    python tools/grammar_engine_bench.py xgrammar   [--tokenizer PATH] [--json]

For each engine: tokenizer init (from ``tokenizer.json``), grammar compile time for a few JSON schemas
(first compile and, where the engine caches, a second one), and per-token time of the decode loop
(compute the next-token bitmask, then advance on the token) over a valid instance of each schema,
tokenized by the tokenizer itself. Used for docs/structured-outputs.md; xgrammar is measured in a
side environment (it is not a dependency of NInfer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

DEFAULT_TOKENIZER = Path("/work/shared/testdata/qwen3_6_tokenizer/tokenizer.json")

SCHEMAS: dict[str, tuple[dict, object]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "ok": True},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "kind": {"enum": ["book", "film", "song"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                "meta": {
                    "type": "object",
                    "properties": {"score": {"type": "number"}, "lang": {"type": "string"}},
                    "required": ["score"],
                    "additionalProperties": False,
                },
            },
            "required": ["id", "kind", "tags", "meta"],
            "additionalProperties": False,
        },
        {"id": 42, "kind": "film", "tags": ["noir", "1940s"], "meta": {"score": 8.5, "lang": "en"}},
    ),
    "wide": (
        {
            "type": "object",
            "properties": {f"field_{i}": {"type": ["string", "integer", "null"]} for i in range(24)},
            "required": [f"field_{i}" for i in range(24)],
            "additionalProperties": False,
        },
        {f"field_{i}": (i if i % 3 == 0 else None if i % 3 == 1 else f"v{i}") for i in range(24)},
    ),
}


def _special_ids(tokenizer_json: str) -> list[int]:
    data = json.loads(tokenizer_json)
    stops = ("<|im_end|>", "<|endoftext|>")
    return [t["id"] for t in data.get("added_tokens", []) if t.get("content") in stops]


def bench_llguidance(tokenizer_path: Path) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    text = tokenizer_path.read_text()
    eos = _special_ids(text)
    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(text, eos_token=eos)
    init_s = time.perf_counter() - t0
    out: dict = {"engine": "llguidance", "version": llguidance.__version__, "vocab": tok.vocab_size,
                 "tokenizer_init_s": init_s, "schemas": {}}  # fmt: skip
    mask = lnp.allocate_token_bitmask(1, tok.vocab_size)
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(tok, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        assert not matcher.is_error(), matcher.get_error()
        t0 = time.perf_counter()
        llguidance.LLMatcher(tok, grammar, log_level=0)
        recompile_s = time.perf_counter() - t0
        ids = tok.tokenize_str(json.dumps(instance, separators=(",", ":")))
        per = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            ok = matcher.consume_token(t)
            per.append(time.perf_counter() - t0)
            assert ok, matcher.get_error()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        assert matcher.is_accepting()
        out["schemas"][name] = _stats(compile_s, recompile_s, per)
    return out


def bench_xgrammar(tokenizer_path: Path) -> dict:
    import transformers
    import xgrammar as xgr

    text = tokenizer_path.read_text()
    eos = _special_ids(text)
    t0 = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path))
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    init_s = time.perf_counter() - t0
    out: dict = {"engine": "xgrammar", "vocab": info.vocab_size, "tokenizer_init_s": init_s, "schemas": {}}
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    options = {"any_whitespace": False, "separators": (",", ":")}
    for name, (schema, instance) in SCHEMAS.items():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(schema), **options)
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiler.compile_json_schema(json.dumps(schema), **options)  # the compiler's cache
        recompile_s = time.perf_counter() - t0
        ids = hf.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
        per = []
        for t in ids:
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            ok = matcher.accept_token(t)
            per.append(time.perf_counter() - t0)
            assert ok, f"token {t} refused"
        matcher.fill_next_token_bitmask(mask)
        assert matcher.accept_token(eos[0]) and matcher.is_terminated()
        out["schemas"][name] = _stats(compile_s, recompile_s, per)
    return out


def _stats(compile_s: float, recompile_s: float, per: list[float]) -> dict:
    per_us = sorted(x * 1e6 for x in per)
    return {
        "compile_ms": round(compile_s * 1e3, 2),
        "recompile_ms": round(recompile_s * 1e3, 2),
        "tokens": len(per),
        "mask_us_mean": round(statistics.fmean(per_us), 1),
        "mask_us_p50": round(per_us[len(per_us) // 2], 1),
        "mask_us_max": round(per_us[-1], 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine", choices=("llguidance", "xgrammar"))
    parser.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = (bench_llguidance if args.engine == "llguidance" else bench_xgrammar)(args.tokenizer)
    result["python"] = sys.version.split()[0]
    result["tokenizer"] = str(args.tokenizer)
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
