"""The training forward against the family's inference forward, the MTP head, gradients, package dims."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from demo_helpers import fresh_rows_batch, perturbed_model
from ninfer_tools.train_demo.model import causal_conv1d_batched, train_forward

from ninfer.ops.conv import causal_conv1d
from ninfer.targets.qwen3_6.model import StateStore, forward, mtp_forward
from ninfer.targets.qwen3_6.weights import weight_schema
from ninfer.targets.qwen3_6_demo import PACKAGE, VARIANT

torch.set_num_threads(1)
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def model_and_ids() -> tuple:
    torch.manual_seed(0)
    model = perturbed_model(VARIANT, seed=3)
    ids = torch.randint(0, VARIANT.vocab_size, (2, 80))  # 80 > one 64-token GDN chunk
    return model, ids


def test_package_shape() -> None:
    v = VARIANT
    assert v.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",
    )
    assert v.vision is None and v.mtp_num_hidden_layers == 1 and not v.moe
    assert v.num_attention_heads // v.num_kv_heads == 6  # Qwen3.6-27B: 24 q / 4 kv
    assert v.linear_num_value_heads // v.linear_num_key_heads == 3  # 48 v / 16 k
    assert 2 * sum(v.mrope_section) == v.rotary_dim == 16
    assert v.hf_config()["text_config"]["layer_types"] == list(v.layer_types)


def test_artifact_fits_24_mb() -> None:
    """bf16 weights (fp32 for the decay parameters) plus a tokenizer.json margin stay under 24 MB."""
    params = sum(math.prod(s.shape) for s in weight_schema(VARIANT))
    weight_bytes = sum(math.prod(s.shape) * (4 if s.keep_fp32 else 2) for s in weight_schema(VARIANT))
    assert 9e6 < params < 12e6
    assert weight_bytes + 600_000 < 24_000_000


def test_batched_conv_equals_the_reference_op() -> None:
    torch.manual_seed(1)
    x = torch.randn(3, 37, 10)
    w = torch.randn(10, 4)
    got = causal_conv1d_batched(x, w)
    for row in range(3):
        want, _ = causal_conv1d(x[row], w)
        torch.testing.assert_close(got[row], want, rtol=1e-6, atol=1e-6)


def test_training_logits_equal_the_inference_forward(model_and_ids: tuple) -> None:
    """Two fresh rows through the family forward (paged KV, GDN state slots) give the same logits (fp32)."""
    model, ids = model_and_ids
    with torch.no_grad():
        ours = train_forward(model.view(), VARIANT, ids)
        batch, store = fresh_rows_batch(VARIANT, ids)
        ref = forward(model.view(), VARIANT, batch, store, logits="all")
    assert ref.logits is not None
    torch.testing.assert_close(ours.logits, ref.logits.view(2, 80, -1), **TOL)
    torch.testing.assert_close(ours.hidden, ref.hidden.view(2, 80, -1), **TOL)
    assert ours.logits.std() > 1.0  # not a degenerate comparison


def test_mtp_equals_the_family_mtp_forward_over_paged_kv(model_and_ids: tuple) -> None:
    """The trainer's MTP slot i (fc over [norm(embed(x_{i+1})); norm(h_i)] at position i, the MTP layer,
    mtp.norm, lm_head) equals the family's `mtp_forward` over paged KV, the drafter's math."""
    model, ids = model_and_ids
    view = model.view()
    with torch.no_grad():
        ours = train_forward(view, VARIANT, ids)
        assert ours.mtp_logits is not None and ours.mtp_logits.shape == (2, 79, VARIANT.vocab_size)
        hid = ours.hidden[:, :-1].reshape(-1, VARIANT.hidden_size)
        batch, _ = fresh_rows_batch(VARIANT, ids[:, 1:])
        store = StateStore.allocate_kv(VARIANT, 1, batch.block_table.numel(), 16, torch.float32, "cpu")
        out = mtp_forward(view, VARIANT, ids[:, 1:].reshape(-1), hid, batch, store)
        want = F.linear(out, view.text.lm_head).view(2, 79, -1)
    torch.testing.assert_close(ours.mtp_logits, want, **TOL)


def test_joint_loss_reaches_every_parameter() -> None:
    model = perturbed_model(VARIANT, seed=5)
    ids = torch.randint(0, VARIANT.vocab_size, (2, 33))
    out = model(ids[:, :-1])
    assert out.mtp_logits is not None
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids[:, 1:].flatten()) + 0.3 * F.cross_entropy(
        out.mtp_logits.flatten(0, 1), ids[:, 2:].flatten()
    )
    loss.backward()
    names = model.names
    no_grad = [
        n for n, p in zip(names, model.tensors().values()) if p.grad is None or p.grad.abs().sum() == 0
    ]
    assert no_grad == []
    mtp_only = [n for n in names if n.startswith("mtp.")]
    assert mtp_only and PACKAGE.variant.tie_word_embeddings


def test_dropout_is_training_only(model_and_ids: tuple) -> None:
    model, ids = model_and_ids
    with torch.no_grad():
        plain = train_forward(model.view(), VARIANT, ids[:, :20])
        torch.manual_seed(0)
        dropped = train_forward(model.view(), VARIANT, ids[:, :20], dropout=0.5)
        again = train_forward(model.view(), VARIANT, ids[:, :20], dropout=0.0)
    assert not torch.allclose(plain.logits, dropped.logits)
    torch.testing.assert_close(plain.logits, again.logits, rtol=0, atol=0)
