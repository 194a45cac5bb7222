"""Reference Gated DeltaNet vs transformers' torch_chunk/torch_recurrent_gated_delta_rule and a naive loop."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating, recurrent_gated_delta_rule

torch.set_num_threads(1)
KEY_HEADS, VALUE_HEADS, DK, DV = 2, 4, 16, 24


def _inputs(seq_len: int, seed: int, batch: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Random GDN inputs with unexpanded key heads (as the model produces them) and realistic gates."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(*batch, seq_len, VALUE_HEADS, generator=gen)
    b = torch.randn(*batch, seq_len, VALUE_HEADS, generator=gen)
    A_log = torch.log(torch.empty(VALUE_HEADS).uniform_(0.5, 4, generator=gen))
    dt_bias = torch.randn(VALUE_HEADS, generator=gen) * 0.5
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    return {
        "q": torch.randn(*batch, seq_len, KEY_HEADS, DK, generator=gen),
        "k": torch.randn(*batch, seq_len, KEY_HEADS, DK, generator=gen),
        "v": torch.randn(*batch, seq_len, VALUE_HEADS, DV, generator=gen),
        "g": g,
        "beta": beta,
        "state": torch.randn(*batch, VALUE_HEADS, DK, DV, generator=gen) * 0.3,
    }


def _expand(t: torch.Tensor) -> torch.Tensor:
    """Key heads -> value heads: value head j uses key head j // (VALUE_HEADS / KEY_HEADS)."""
    return t.repeat_interleave(VALUE_HEADS // KEY_HEADS, dim=-2)


def _naive_float64(inp: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """S_t = (I - b k k^T) a S_{t-1} + b k v^T, o_t = S_t^T q_t per head, in float64, one sequence."""
    q, k = _expand(inp["q"]).double(), _expand(inp["k"]).double()
    q = q / q.norm(dim=-1, keepdim=True) / math.sqrt(DK)
    k = k / k.norm(dim=-1, keepdim=True)
    v, g, beta = inp["v"].double(), inp["g"].double(), inp["beta"].double()
    states = [inp["state"][h].double() for h in range(VALUE_HEADS)]
    out = torch.zeros(q.shape[0], VALUE_HEADS, DV, dtype=torch.float64)
    eye = torch.eye(DK, dtype=torch.float64)
    for t in range(q.shape[0]):
        for h in range(VALUE_HEADS):
            k_t = k[t, h][:, None]
            states[h] = (eye - beta[t, h] * k_t @ k_t.T) @ (g[t, h].exp() * states[h]) + beta[t, h] * k_t @ v[
                t, h
            ][None]
            out[t, h] = states[h].T @ q[t, h]
    return out, torch.stack(states)


def test_gdn_gating_formula() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=gen).bfloat16(), torch.randn(3, 5, generator=gen).bfloat16()
    A_log, dt_bias = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32 and bool((g <= 0).all())
    for i in range(3):
        for h in range(5):
            softplus = math.log1p(math.exp(a[i, h].item() + dt_bias[h].item()))
            assert math.isclose(g[i, h].item(), -math.exp(A_log[h].item()) * softplus, rel_tol=1e-5)
            assert math.isclose(beta[i, h].item(), 1 / (1 + math.exp(-b[i, h].item())), rel_tol=1e-5)


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(150, 64), (37, 16), (1, 64)])
def test_chunk_matches_hf_and_naive(seq_len: int, chunk_size: int) -> None:
    inp = _inputs(seq_len, seed=seq_len)
    state_before = inp["state"].clone()
    o, final = chunk_gated_delta_rule(
        _expand(inp["q"]), _expand(inp["k"]), inp["v"], inp["g"], inp["beta"], inp["state"], chunk_size
    )
    assert o.shape == (seq_len, VALUE_HEADS, DV) and o.dtype == final.dtype == torch.float32
    assert torch.equal(inp["state"], state_before)
    # Key heads are expanded before the HF call too: transformers < 5.2x does not repeat them itself.
    hf_o, hf_final = hf.torch_chunk_gated_delta_rule(
        _expand(inp["q"])[None],
        _expand(inp["k"])[None],
        inp["v"][None],
        inp["g"][None],
        inp["beta"][None],
        chunk_size=chunk_size,
        initial_state=inp["state"][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, hf_o[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, hf_final[0], rtol=1e-5, atol=1e-5)
    naive_o, naive_final = _naive_float64(inp)
    torch.testing.assert_close(o.double(), naive_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final.double(), naive_final, rtol=1e-5, atol=1e-5)


def test_recurrent_matches_hf_and_chunked_and_keeps_all_states() -> None:
    seq_len = 70
    inp = _inputs(seq_len, seed=3)
    q, k = _expand(inp["q"]), _expand(inp["k"])
    o, final, all_states = recurrent_gated_delta_rule(
        q, k, inp["v"], inp["g"], inp["beta"], inp["state"], return_all_states=True
    )
    assert all_states.shape == (seq_len, VALUE_HEADS, DK, DV)
    hf_o, hf_final = hf.torch_recurrent_gated_delta_rule(
        _expand(inp["q"])[None],
        _expand(inp["k"])[None],
        inp["v"][None],
        inp["g"][None],
        inp["beta"][None],
        initial_state=inp["state"][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    torch.testing.assert_close(o, hf_o[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, hf_final[0], rtol=1e-5, atol=1e-5)
    chunk_o, chunk_final = chunk_gated_delta_rule(q, k, inp["v"], inp["g"], inp["beta"], inp["state"])
    torch.testing.assert_close(o, chunk_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, chunk_final, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(all_states[-1], final, rtol=0, atol=0)
    for prefix in (1, 33):  # the state after position t is what a run over t+1 tokens ends in
        _, prefix_final = recurrent_gated_delta_rule(
            q[:prefix], k[:prefix], inp["v"][:prefix], inp["g"][:prefix], inp["beta"][:prefix], inp["state"]
        )
        torch.testing.assert_close(all_states[prefix - 1], prefix_final, rtol=0, atol=0)


def test_split_prefill_and_decode_steps_continue_the_state() -> None:
    inp = _inputs(90, seed=4)
    q, k, v, g, beta = _expand(inp["q"]), _expand(inp["k"]), inp["v"], inp["g"], inp["beta"]
    full_o, full_state = chunk_gated_delta_rule(q, k, v, g, beta, None)
    o_a, state = chunk_gated_delta_rule(q[:70], k[:70], v[:70], g[:70], beta[:70], None)
    outputs = [o_a]
    for t in range(70, 90):
        o_t, state = recurrent_gated_delta_rule(
            q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state
        )
        outputs.append(o_t)
    torch.testing.assert_close(torch.cat(outputs), full_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, full_state, rtol=1e-5, atol=1e-5)


def test_without_qk_l2norm_matches_hf() -> None:
    inp = _inputs(20, seed=5)
    inp["k"] = inp["k"] / inp["k"].norm(dim=-1, keepdim=True)  # keep the recurrence bounded
    o, final = chunk_gated_delta_rule(
        _expand(inp["q"]),
        _expand(inp["k"]),
        inp["v"],
        inp["g"],
        inp["beta"],
        inp["state"],
        chunk_size=8,
        use_qk_l2norm=False,
    )
    hf_o, hf_final = hf.torch_chunk_gated_delta_rule(
        _expand(inp["q"])[None],
        _expand(inp["k"])[None],
        inp["v"][None],
        inp["g"][None],
        inp["beta"][None],
        chunk_size=8,
        initial_state=inp["state"][None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    torch.testing.assert_close(o, hf_o[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, hf_final[0], rtol=1e-5, atol=1e-5)


def test_leading_batch_dim_equals_per_sequence_runs() -> None:
    inp = _inputs(11, seed=6, batch=(3,))
    q, k = _expand(inp["q"]), _expand(inp["k"])
    for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        o, final = fn(q, k, inp["v"], inp["g"], inp["beta"], inp["state"])
        for i in range(3):
            o_i, final_i = fn(q[i], k[i], inp["v"][i], inp["g"][i], inp["beta"][i], inp["state"][i])
            torch.testing.assert_close(o[i], o_i, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(final[i], final_i, rtol=1e-6, atol=1e-6)


def test_empty_sequence_returns_initial_state() -> None:
    inp = _inputs(0, seed=7)
    q, k = _expand(inp["q"]), _expand(inp["k"])
    o, final = chunk_gated_delta_rule(q, k, inp["v"], inp["g"], inp["beta"], inp["state"])
    o_r, final_r, states = recurrent_gated_delta_rule(
        q, k, inp["v"], inp["g"], inp["beta"], inp["state"], return_all_states=True
    )
    assert o.shape == o_r.shape == (0, VALUE_HEADS, DV) and states.shape == (0, VALUE_HEADS, DK, DV)
    assert torch.equal(final, inp["state"]) and torch.equal(final_r, inp["state"])


def test_chunked_gradients_match_recurrent() -> None:
    inp = _inputs(40, seed=8)
    names = ["q", "k", "v", "g", "beta", "state"]
    upstream = torch.randn(40, VALUE_HEADS, DV, generator=torch.Generator().manual_seed(9))

    def grads(fn) -> list[torch.Tensor]:
        leaves = {n: inp[n].clone().requires_grad_(True) for n in names}
        o, final = fn(
            _expand(leaves["q"]),
            _expand(leaves["k"]),
            leaves["v"],
            leaves["g"],
            leaves["beta"],
            leaves["state"],
        )
        ((o * upstream).sum() + final.pow(2).sum()).backward()
        return [leaves[n].grad for n in names]

    chunk_grads = grads(lambda *a: chunk_gated_delta_rule(*a, chunk_size=16))
    recurrent_grads = grads(recurrent_gated_delta_rule)
    for name, g_chunk, g_rec in zip(names, chunk_grads, recurrent_grads, strict=True):
        assert g_chunk is not None and bool(g_chunk.abs().sum() > 0), name
        torch.testing.assert_close(g_chunk, g_rec, rtol=1e-4, atol=1e-5, msg=name)
