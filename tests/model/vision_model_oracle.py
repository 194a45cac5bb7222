"""The end-to-end vision oracle: NInfer's Frontend + vision tower + text forward against transformers'
Qwen3_5(Moe)ForConditionalGeneration holding the same tiny random weights.

For the lead integrating the tower into the Program: `prefill_embeddings` is the whole splice (token
embeddings, tower output written at the pad rows), `prefill_batch` the StepBatch a Program would build
(M-RoPE positions from the prompt, inputs_embeds), `decode_positions` the positions of decode steps
(``cache_len + mrope_delta`` on all three axes); `check_against_transformers` compares each piece.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from qwen3_6_model_harness import RowStep, make_batch, rel_err, tiny_view

from ninfer.targets.qwen3_6.binder import hf_state_dict
from ninfer.targets.qwen3_6.frontend.types import PreparedPrompt
from ninfer.targets.qwen3_6.model import StateStore, StepBatch, forward
from ninfer.targets.qwen3_6.view import ModelView
from ninfer.targets.qwen3_6.vision import image_pad_rows, vision_embeddings
from ninfer.targets.registry import PACKAGES

PAGE_SIZE = 16


@functools.cache
def hf_vision_model(package_name: str) -> torch.nn.Module:
    """transformers' Qwen3_5(Moe)VisionModel with `tiny_view`'s ``visual.*`` weights (eager attention)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    config = Qwen3_5VisionConfig(**PACKAGES[package_name].hf_config()["vision_config"])
    config._attn_implementation = "eager"
    model = Qwen3_5VisionModel(config).float().eval()
    view = tiny_view(package_name)
    model.load_state_dict(
        {k[len("visual.") :]: v for k, v in view.tensors.items() if k.startswith("visual.")}
    )
    return model


@functools.cache
def hf_vlm(package_name: str) -> torch.nn.Module:
    """transformers' Qwen3_5(Moe)ForConditionalGeneration with all of `tiny_view`'s weights but MTP."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    package = PACKAGES[package_name]
    cfg, cls = (
        (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        if package.variant.moe
        else (Qwen3_5Config, Qwen3_5ForConditionalGeneration)
    )
    config = cfg(**package.hf_config())
    for c in (config, config.text_config, config.vision_config):
        c._attn_implementation = "eager"  # fp32 softmax, no SDPA kernel differences
    model = cls(config).float().eval()
    state = {k: v for k, v in hf_state_dict(tiny_view(package_name)).items() if not k.startswith("mtp.")}
    model.load_state_dict(state, strict=True)
    return model


def hf_inputs(prompt: PreparedPrompt, image_pad: int) -> dict[str, torch.Tensor]:
    """The prompt as transformers' processor would hand it to the model."""
    ids = torch.tensor([prompt.token_ids])
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "mm_token_type_ids": (ids == image_pad).long(),
        "pixel_values": torch.from_numpy(np.concatenate([img.pixel_values for img in prompt.images])),
        "image_grid_thw": torch.tensor([img.grid_thw for img in prompt.images]),
    }


def tower(view: ModelView, prompt: PreparedPrompt) -> torch.Tensor:
    """NInfer's vision embeddings of all the prompt's images, [image tokens, hidden]."""
    assert view.variant.vision is not None and view.vision is not None
    pixel_values = torch.from_numpy(np.concatenate([img.pixel_values for img in prompt.images]))
    with torch.no_grad():
        return vision_embeddings(
            view.vision, view.variant.vision, pixel_values, [img.grid_thw for img in prompt.images]
        )


def prefill_embeddings(view: ModelView, prompt: PreparedPrompt) -> torch.Tensor:
    """[L, H]: the token embeddings with each image's tower rows written over its pads."""
    embeds = F.embedding(torch.tensor(prompt.token_ids), view.text.embed)
    rows = image_pad_rows([(img.token_offset, img.num_tokens) for img in prompt.images])
    embeds[rows] = tower(view, prompt).to(embeds.dtype)
    return embeds


def prefill_batch(view: ModelView, prompt: PreparedPrompt, pages: list[int]) -> StepBatch:
    """One fresh row holding the whole prompt, with M-RoPE positions and the spliced embeddings."""
    batch = make_batch([RowStep(list(prompt.token_ids), 0, pages, 0, 1, fresh=True)], PAGE_SIZE)
    assert prompt.mrope_positions is not None
    positions = torch.from_numpy(np.array(prompt.mrope_positions))
    return dataclasses.replace(batch, positions=positions, inputs_embeds=prefill_embeddings(view, prompt))


def decode_positions(batch: StepBatch, prompt: PreparedPrompt) -> StepBatch:
    """A decode row's positions: its cache position plus the prompt's delta, on all three axes."""
    return dataclasses.replace(batch, positions=batch.positions + prompt.mrope_delta)


def our_greedy(view: ModelView, prompt: PreparedPrompt, steps: int) -> tuple[torch.Tensor, list[int]]:
    """(prefill logits [L, V], greedy continuation) from NInfer's forward."""
    n_pages = math.ceil((len(prompt.token_ids) + steps) / PAGE_SIZE)
    store = StateStore.allocate(view.variant, 2, n_pages + 1, PAGE_SIZE, torch.float32, "cpu")
    pages = list(range(1, n_pages + 1))
    with torch.no_grad():
        out = forward(view, view.variant, prefill_batch(view, prompt, pages), store, logits="all")
        assert out.logits is not None
        tokens = [int(out.logits[-1].argmax())]
        for k in range(steps - 1):
            row = RowStep([tokens[-1]], len(prompt.token_ids) + k, pages, 1, 1)
            step = forward(view, view.variant, decode_positions(make_batch([row], PAGE_SIZE), prompt), store)
            assert step.logits is not None
            tokens.append(int(step.logits[-1].argmax()))
    return out.logits, tokens


def check_against_transformers(package_name: str, prompt: PreparedPrompt, steps: int = 0) -> dict[str, Any]:
    """Each piece against transformers: image features, positions/delta, prefill logits, greedy tokens."""
    view = tiny_view(package_name)
    model = hf_vlm(package_name)
    inputs = hf_inputs(prompt, view.variant.special.image_pad)
    with torch.no_grad():
        features = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        hf_features = torch.cat(features.pooler_output)
        positions, delta = model.model.get_rope_index(
            inputs["input_ids"],
            mm_token_type_ids=inputs["mm_token_type_ids"],
            image_grid_thw=inputs["image_grid_thw"],
        )
    assert prompt.mrope_positions is not None
    result: dict[str, Any] = {
        "feature_err": rel_err(tower(view, prompt), hf_features),
        "positions_equal": bool(
            torch.equal(positions[:, 0], torch.from_numpy(np.array(prompt.mrope_positions)))
        ),
        "delta_equal": int(delta.item()) == prompt.mrope_delta,
    }
    if steps:
        ours_logits, ours_tokens = our_greedy(view, prompt, steps)
        model.model.rope_deltas = None  # transformers keeps it between calls
        with torch.no_grad():
            hf_logits = model(**inputs, use_cache=False).logits[0]
            model.model.rope_deltas = None
            generated = model.generate(
                **inputs, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        result["logits_err"] = rel_err(ours_logits, hf_logits)
        result["ours_tokens"] = ours_tokens
        result["hf_tokens"] = generated[0, len(prompt.token_ids) :].tolist()
    return result
