"""Shared pieces of the end-to-end tests: prompts, Engine settings and the transformers oracle.

The oracle is `hf_causal_lm(name)` from tests/tiny_artifacts.py: transformers' Qwen3_5(Moe)ForCausalLM
holding exactly the weights written into the `tiny_artifact` / `tiny_moe_artifact` files.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from tiny_artifacts import hf_causal_lm
from tokenizers import Tokenizer

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.targets.qwen3_6.resources import RESOURCE_DIR

PACKAGE_NAMES = ("qwen3_6_tiny", "qwen3_6_tiny_moe")
ARTIFACT_FIXTURE = {"qwen3_6_tiny": "tiny_artifact", "qwen3_6_tiny_moe": "tiny_moe_artifact"}
FIRST_SPECIAL_ID = 248044  # ids below this are ordinary tokens of the real Qwen3.6 tokenizer
# 16 prompt lengths from 1 to 80: below, at and across the 16-token prefill chunk and page boundaries.
# The first eight fit one chunk, so all eight lanes fill before the first request finishes.
PROMPT_LENGTHS = (1, 2, 3, 5, 8, 11, 15, 16, 17, 24, 32, 33, 47, 55, 64, 80)
MAX_CONTEXT = 128
PAGE_SIZE = 16
PREFILL_CHUNK = 16


def artifact_for(request: pytest.FixtureRequest, name: str) -> Path:
    """The session-scoped .ninfer file of package ``name`` (tests/conftest.py fixtures)."""
    return request.getfixturevalue(ARTIFACT_FIXTURE[name])


def random_prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    """Raw token-id prompts of ordinary (non-special) tokens, reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, FIRST_SPECIAL_ID, (n,), generator=g).tolist() for n in lengths]


def generation_config(max_concurrency: int, **overrides: object) -> EngineConfig:
    """A small CPU generation Engine: short context, small pages and prefill chunks (so prompts span
    several pages and chunks), no warmup unless asked."""
    fields: dict[str, object] = dict(
        max_concurrency=max_concurrency,
        device="cpu",
        dtype="float32",
        max_context=MAX_CONTEXT,
        page_size=PAGE_SIZE,
        prefill_chunk_tokens=PREFILL_CHUNK,
        warmup=False,
    )
    fields.update(overrides)
    return EngineConfig(**fields)  # type: ignore[arg-type]


@functools.cache
def hf_greedy(name: str, prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    """transformers' greedy ``generate`` with end-of-sequence disabled (the Engine side uses ignore_eos)."""
    model = hf_causal_lm(name)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([list(prompt)]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    new = tuple(out[0, len(prompt) :].tolist())
    assert len(new) == max_new_tokens, "transformers stopped early: end-of-sequence was not disabled"
    return new


def hf_next_token_logits(name: str, ids: Sequence[int]) -> torch.Tensor:
    """fp32 logits [len(ids), V] of the token after each prefix ``ids[:i+1]``, one fresh forward."""
    model = hf_causal_lm(name)
    with torch.no_grad():
        return model(torch.tensor([list(ids)]), use_cache=False).logits[0].float()


def hf_logprobs(name: str, ids: Sequence[int]) -> list[float]:
    """``out[i] = log p(ids[i+1] | ids[:i+1])`` by transformers over the whole sequence."""
    logp = torch.log_softmax(hf_next_token_logits(name, ids)[:-1].double(), dim=-1)
    targets = torch.tensor(list(ids[1:]))
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()


@functools.cache
def _fixture_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(RESOURCE_DIR / "tokenizer.json"))


def fixture_tokenizer_ids(text: str) -> list[int]:
    """The real Qwen3.6 tokenizer (ninfer/targets/qwen3_6/resources) on raw text, no special tokens added."""
    return _fixture_tokenizer().encode(text, add_special_tokens=False).ids


def homogeneity_p(a: list, b: list) -> float:
    """p-value of a chi-square test that two samples come from one distribution (rare cells pooled)."""
    ca, cb = Counter(a), Counter(b)
    cells = sorted(set(ca) | set(cb), key=lambda x: -(ca[x] + cb[x]))
    big = [c for c in cells if ca[c] + cb[c] >= 10]
    rows = [(ca[c], cb[c]) for c in big]
    rest = (sum(ca[c] for c in cells if c not in big), sum(cb[c] for c in cells if c not in big))
    if sum(rest):
        rows.append(rest)
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        total = x + y
        for observed, n in ((x, na), (y, nb)):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(rows) - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2.0, dtype=torch.float64), torch.tensor(stat / 2.0, dtype=torch.float64)
        )
    )


# ---- speculative decoding against plain decoding (MTP, DFlash) ----

SAMPLED_PROMPT = "def main():\n    "
# prompts the demo model continues with code (its draft heads accept much of it)
DEMO_TEXTS = (
    "def fibonacci(n):\n    ",
    "import numpy as np\nimport",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "for i in range(10):\n    print(",
    "# Read a file line by line\nwith open(path) as f:\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "x = [1, 2, 3]\ny = [",
    "The quick brown fox",
)


def demo_engine(artifact: Path | str, spec: str | None, max_concurrency: int = 1, **fields: object) -> Engine:
    """A CPU fp32 Engine on a demo artifact, decoding with ``spec`` (None: plain), the cache off unless
    ``fields`` say otherwise."""
    settings: dict[str, object] = {"prefix_cache": False, **fields}
    config = EngineConfig(
        device="cpu", dtype="float32", speculative=spec, warmup=False, max_concurrency=max_concurrency,
        max_context=512, queue_capacity=512, **settings,  # type: ignore[arg-type]
    )  # fmt: skip
    return Engine(str(artifact), config)


def demo_request(text: str, max_tokens: int, **fields: object) -> GenerationRequest:
    return GenerationRequest(prompt=text, max_tokens=max_tokens, temperature=0.0, logprobs=True, **fields)  # type: ignore[arg-type]


def ending_requests(plain: Sequence[GenerationResult]) -> list[GenerationRequest]:
    """`DEMO_TEXTS` ending where their plain runs ``plain`` (40 tokens each) would end them inside a
    draft: by a stop token, a stop string or max_tokens in turn; then a thinking chat whose budget forces
    its control."""
    requests = []
    for i, (text, ref) in enumerate(zip(DEMO_TEXTS, plain)):
        cut = 5 + i % 7
        if i % 3 == 0:
            requests.append(demo_request(text, 40, stop_token_ids=[ref.token_ids[cut]]))
        elif i % 3 == 1:
            requests.append(
                demo_request(text, 40, stop=[ref.text[len(ref.text) // 2 : len(ref.text) // 2 + 3]])
            )
        else:
            requests.append(demo_request(text, cut))
    chat = GenerationRequest(
        messages=[{"role": "user", "content": "Write a loop in Python."}], max_tokens=30, temperature=0.0,
        thinking_budget=4, chat_template_kwargs={"enable_thinking": True},
    )  # fmt: skip
    return [*requests, chat]


def run_all(engine: Engine, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """The requests submitted together, their results in order."""
    handles = [engine.submit(r) for r in requests]
    return [h.result() for h in handles]


def assert_same(got: list[GenerationResult], want: list[GenerationResult]) -> None:
    """Tokens and finish reasons equal, log-probs within 1e-4."""
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    for a, b in zip(got, want):
        if b.logprobs is not None:
            assert a.logprobs is not None
            worst = max((abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
            assert worst <= 1e-4, worst


def greedy_requests() -> list[GenerationRequest]:
    """Eight greedy requests with log-probs: random prompts of 1-64 tokens, 4-25 tokens each."""
    prompts = random_prompts([1, 5, 17, 33, 48, 9, 64, 2], seed=11)
    return [
        GenerationRequest(prompt=p, max_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=True)
        for i, p in enumerate(prompts)
    ]


def sampled_tokens(engine: Engine, seeds: range) -> list[tuple[int, ...]]:
    """Four tokens sampled (T 0.8, top-k 20) after `SAMPLED_PROMPT`, one seeded request per seed."""
    requests = [
        GenerationRequest(
            prompt=SAMPLED_PROMPT, max_tokens=4, temperature=0.8, top_k=20, seed=s, ignore_eos=True
        )
        for s in seeds
    ]
    return [r.token_ids for r in run_all(engine, requests)]


def coding_session(engine: Engine, system: str, *, cache: bool, turns: int = 4) -> list[tuple[int, ...]]:
    """A greedy session of ``turns`` coding questions (one session id); each turn past the first reuses
    a prefix exactly when ``cache``. The turns' tokens."""
    messages: list[dict] = [{"role": "system", "content": system}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Write function number {turn} in Python."})
        request = GenerationRequest(
            messages=list(messages), max_tokens=24, temperature=0.0, session_id="s",
            chat_template_kwargs={"enable_thinking": False},
        )  # fmt: skip
        result = engine.generate(request)
        assert (result.usage.reused_prefix_tokens > 0) == (cache and turn > 0)
        out.append(result.token_ids)
        messages.append({"role": "assistant", "content": result.text})
    return out
