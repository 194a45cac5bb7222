"""Images through the public Engine: chat requests with 1-3 images (in different messages, crossing
prefill chunks) give transformers' Qwen3_5(Moe)ForConditionalGeneration greedy tokens on the tiny
packages; image and text requests decoding together at max_concurrency 8 give their single-run
outputs; a request over the image-token limit, or with images on a package without a tower, is
rejected alone."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "model"))  # the vision oracle's harness

from qwen3_6_model_harness import tiny_view  # noqa: E402
from vision_model_oracle import hf_inputs, hf_vlm  # noqa: E402
from vision_oracle import SMALL_CONFIG, frontend, png  # noqa: E402

from ninfer import EngineConfig, GenerationRequest  # noqa: E402
from ninfer.media.decode import decode_image  # noqa: E402
from ninfer.runtime.engine.engine import Engine  # noqa: E402
from ninfer.targets.qwen3_6.impl.runtime.program import ProgramConfig, Qwen36Program  # noqa: E402
from ninfer.targets.registry import PACKAGES  # noqa: E402
from ninfer.types import RequestRejected  # noqa: E402

torch.set_num_threads(1)

PACKAGE_NAMES = ("qwen3_6_tiny", "qwen3_6_tiny_moe")
STEPS = 6
SIZES = [(70, 40), (33, 90), (300, 200)]


def _messages(count: int, text: str = "Picture") -> list[dict]:
    parts = [{"type": "image", "image": decode_image(png(*SIZES[i], seed=i))} for i in range(count)]
    messages: list[dict] = [{"role": "system", "content": "Describe images."}]
    for i, part in enumerate(parts):
        messages.append({"role": "user", "content": [{"type": "text", "text": f"{text} {i}?"}, part]})
        if i < count - 1:
            messages.append({"role": "assistant", "content": f"Answer {i}."})
    if not count:
        messages.append({"role": "user", "content": f"{text} without an image?"})
    return messages


def _engine(name: str, max_concurrency: int = 1, max_image_tokens: int = 16384, chunk: int = 7) -> Engine:
    variant = PACKAGES[name].variant
    program = Qwen36Program(
        variant,
        tiny_view(name),
        ProgramConfig(
            max_concurrency=max_concurrency, max_context=256, page_size=16, kv_pages=16 * max_concurrency,
            device=torch.device("cpu"), dtype=torch.float32, max_image_tokens=max_image_tokens,
        ),
    )  # fmt: skip
    config = EngineConfig(
        max_concurrency=max_concurrency, device="cpu", dtype="float32", max_context=256, page_size=16,
        prefill_chunk_tokens=chunk, warmup=False,
    )  # fmt: skip
    return Engine.from_parts(program, frontend(SMALL_CONFIG), config, package_name=name)


def _request(messages: list[dict]) -> GenerationRequest:
    return GenerationRequest(messages=messages, max_tokens=STEPS, temperature=0.0, ignore_eos=True)


@functools.cache
def _hf_tokens(name: str, count: int) -> tuple[int, ...]:
    prompt = frontend(SMALL_CONFIG).prepare_chat(_messages(count))
    model = hf_vlm(name)
    inputs = hf_inputs(prompt, tiny_view(name).variant.special.image_pad)
    model.model.rope_deltas = None  # transformers keeps it between calls
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return tuple(out[0, len(prompt.token_ids) :].tolist())


@pytest.mark.parametrize("name", PACKAGE_NAMES)
@pytest.mark.parametrize("count", [1, 2, 3])
def test_image_chat_gives_transformers_greedy_tokens(name: str, count: int) -> None:
    with _engine(name) as engine:
        result = engine.generate(_request(_messages(count)))
        prompt = frontend(SMALL_CONFIG).prepare_chat(_messages(count))
    assert result.token_ids == _hf_tokens(name, count)
    assert result.usage.prompt_tokens == len(prompt.token_ids)  # the image pads are prompt tokens
    assert prompt.image_tokens > 0


@pytest.mark.parametrize("name", PACKAGE_NAMES)
def test_image_and_text_requests_batched_give_their_single_run_outputs(name: str) -> None:
    requests = [_request(_messages(i % 4, text=f"Case {i}")) for i in range(8)]
    with _engine(name, max_concurrency=1, chunk=64) as engine:
        alone = [engine.generate(r).token_ids for r in requests]
    with _engine(name, max_concurrency=8, chunk=64) as engine:
        handles = [engine.submit(r) for r in requests]
        together = [h.result().token_ids for h in handles]
    assert together == alone


def test_images_over_the_limit_or_without_a_tower_are_refused_alone() -> None:
    with _engine("qwen3_6_tiny", max_image_tokens=3) as engine:
        with pytest.raises(RequestRejected) as err:
            engine.generate(_request(_messages(3)))
        assert err.value.kind == "infeasible" and "max_image_tokens" in err.value.message
        assert engine.generate(_request(_messages(0))).finish_reason == "length"
