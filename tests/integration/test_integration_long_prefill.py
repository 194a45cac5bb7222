"""A 16,380-token prompt, prefilled in chunks through the public Engine, gives transformers' one-shot
forward (fp32) at its last position, at positions inside earlier chunks, and greedy decode continues
equal (issue 30: a 16k-token prompt on the tiny packages, which hold 16,384 positions).

The prefill unit is 1,000 tokens: seventeen chunks, each boundary inside a KV page (64 positions) and
inside a GDN chunk, so every chunk continues the paged KV and the recurrent state of the last. Requests
of the prompt's prefixes of 1,001, 2,500 and 9,999 tokens sample those positions (the Engine returns
logits only at a prompt's end). The oracle runs the whole 16,383 tokens (prompt + the first 3 decoded)
once, causal, with transformers' SDPA attention (its eager attention would hold 6 x 16k x 16k fp32
scores), and keeps the logits of the positions compared (``logits_to_keep``). Log-probs of the chosen
token and of the 20 alternatives the Engine reports must equal transformers' within 1e-4, the tolerance
of the other transformers-equality tests.
"""

from __future__ import annotations

import pytest
import torch
from integration_helpers import PACKAGE_NAMES, artifact_for, random_prompts
from tiny_artifacts import hf_causal_lm

from ninfer import Engine, EngineConfig, GenerationRequest, GenerationResult
from ninfer.targets.registry import PACKAGES

torch.set_num_threads(1)
NEW_TOKENS = 4
CHUNK = 1000
PREFIXES = (CHUNK + 1, 2500, 9999)  # one token into the second chunk; inside the third; the tenth
TOP = 20
TOL = 1e-4

pytestmark = pytest.mark.slow


def logprob_request(prompt: list[int], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        logprobs=True,
        top_logprobs=TOP,
    )


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_a_16k_chunked_prefill_equals_transformers(
    request: pytest.FixtureRequest, name: str
) -> None:
    positions = PACKAGES[name].variant.max_position_embeddings
    assert positions == 16384  # the 16k: the most the package holds
    prompt = random_prompts((positions - NEW_TOKENS,), seed=30)[0]
    config = EngineConfig(
        max_concurrency=1 + len(PREFIXES), device="cpu", dtype="float32", max_context=positions,
        prefill_chunk_tokens=CHUNK, warmup=False, prefix_cache=False,
    )  # fmt: skip
    with Engine(artifact_for(request, name), config) as engine:
        handles = [engine.submit(logprob_request(prompt, NEW_TOKENS))]
        handles += [engine.submit(logprob_request(prompt[:n], 1)) for n in PREFIXES]
        results: list[GenerationResult] = [h.result() for h in handles]
    main, prefixes = results[0], results[1:]
    assert len(main.token_ids) == NEW_TOKENS and main.logprobs is not None

    ids = prompt + list(main.token_ids[:-1])  # teacher-forced: transformers' greedy iff every argmax agrees
    at = [n - 1 for n in PREFIXES] + [len(prompt) - 1 + i for i in range(NEW_TOKENS)]
    with torch.no_grad():
        oracle = hf_causal_lm(name, "sdpa")
        out = oracle(torch.tensor([ids]), use_cache=False, logits_to_keep=torch.tensor(at))
    expected = torch.log_softmax(out.logits[0].double(), dim=-1)  # [len(at), V]

    reported = [r.logprobs[0] for r in prefixes] + list(main.logprobs)  # type: ignore[index]
    for row, logprob in zip(expected, reported):
        assert logprob.token_id == int(row.argmax()), "not transformers' greedy token"
        assert abs(logprob.logprob - float(row[logprob.token_id])) <= TOL
        assert len(logprob.top) == TOP
        worst = max(abs(value - float(row[token])) for token, value in logprob.top)
        assert worst <= TOL, worst
