"""Reference Gated DeltaNet (Qwen3.6 linear attention), plain PyTorch, fp32 math, differentiable.

Per value head the state S [dk, dv] evolves as
    S <- exp(g_t) * S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t
with q, k l2-normalised and q scaled by dk^-0.5. The chunked form is the prefill oracle, the per-step
loop the decode/verify oracle; they agree to fp32 rounding.

Shapes: q, k [..., T, H, dk] with H = value heads (key heads already repeated), v [..., T, H, dv],
g (log-decay, <= 0) and beta [..., T, H], state [..., H, dk, dv] fp32. The leading `...` is optional:
the engine passes one sequence ([T, H, d]); a batch of independent sequences is also accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ninfer.ops.norm import l2norm

__all__ = ["gdn_gating", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]


def gdn_gating(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen GDN gates, fp32: g = -exp(A_log) * softplus(a + dt_bias) (log-decay <= 0), beta = sigmoid(b)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return g, beta


def _prepare_heads_first(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32, heads-first ([..., H, T, d] / [..., H, T]) inputs with q/k normalised and q scaled."""
    q32, k32, v32 = (t.float().transpose(-3, -2) for t in (q, k, v))
    g32, beta32 = (t.float().transpose(-2, -1) for t in (g, beta))
    if use_qk_l2norm:
        q32, k32 = l2norm(q32, eps=1e-6), l2norm(k32, eps=1e-6)
    q32 = q32 * q32.shape[-1] ** -0.5  # always scaled, as in HF and FLA (scale=None)
    return q32, k32, v32, g32, beta32


def _initial_state(
    initial_state: torch.Tensor | None, batch_shape: torch.Size, dk: int, dv: int, like: torch.Tensor
) -> torch.Tensor:
    if initial_state is None:
        return like.new_zeros(*batch_shape, dk, dv)
    return initial_state.to(device=like.device, dtype=torch.float32)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY/UT-transform) gated delta rule for any T -> (o [..., T, H, dv] fp32, final_state fp32).

    Same maths as HF `torch_chunk_gated_delta_rule`: inside a chunk the delta-rule updates are solved
    with one unit-lower-triangular system; chunks are scanned sequentially through the state.
    """
    q32, k32, v32, g32, beta32 = _prepare_heads_first(q, k, v, g, beta, use_qk_l2norm)
    *batch_heads, seq_len, dk = k32.shape
    dv = v32.shape[-1]
    state = _initial_state(initial_state, torch.Size(batch_heads), dk, dv, v32)
    if seq_len == 0:
        return v32.new_zeros(*v.shape), state

    pad = (chunk_size - seq_len % chunk_size) % chunk_size
    # Zero-padded tail tokens have k = v = 0 and g = 0: they neither decay nor write the state.
    q32, k32, v32 = (F.pad(t, (0, 0, 0, pad)) for t in (q32, k32, v32))
    g32, beta32 = (F.pad(t, (0, pad)) for t in (g32, beta32))
    num_chunks = (seq_len + pad) // chunk_size

    def chunked(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(*t.shape[:-2], num_chunks, chunk_size, t.shape[-1])

    q_c, k_c, v_c = chunked(q32), chunked(k32), chunked(v32)
    beta_c = beta32.reshape(*beta32.shape[:-1], num_chunks, chunk_size).unsqueeze(-1)
    cum_decay = g32.reshape(*g32.shape[:-1], num_chunks, chunk_size).cumsum(-1)  # log decay from chunk start

    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q32.device).tril()
    # pairwise[i, j] = prod of decays in (j, i] for j <= i; exp of a masked -inf is exactly 0.
    pairwise = (cum_decay.unsqueeze(-1) - cum_decay.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()

    k_beta, v_beta = k_c * beta_c, v_c * beta_c
    # (I + strictly_lower(A)) solves the chunk's chained delta-rule updates (the diagonal is implied 1).
    ut_system = (k_beta @ k_c.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut_system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(
        ut_system, k_beta * cum_decay.exp().unsqueeze(-1), upper=False, unitriangular=True
    )
    intra_attn = (q_c @ k_c.transpose(-1, -2)) * pairwise
    q_decayed = q_c * cum_decay.exp().unsqueeze(-1)
    k_to_end = k_c * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    outputs: list[torch.Tensor] = []
    for i in range(num_chunks):
        v_new = new_values[..., i, :, :] - k_cumdecay[..., i, :, :] @ state
        outputs.append(q_decayed[..., i, :, :] @ state + intra_attn[..., i, :, :] @ v_new)
        state = state * chunk_decay[..., i, :, :] + k_to_end[..., i, :, :].transpose(-1, -2) @ v_new

    o = torch.cat(outputs, dim=-2)[..., :seq_len, :]  # [..., H, T, dv]
    return o.transpose(-3, -2).contiguous(), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    return_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-step gated delta rule -> (o [..., T, H, dv] fp32, final_state) [+ all_states [..., T, H, dk, dv]].

    all_states[t] is the state after position t (speculative verify commits the accepted one).
    The input state is never modified.
    """
    q32, k32, v32, g32, beta32 = _prepare_heads_first(q, k, v, g, beta, use_qk_l2norm)
    *batch_heads, seq_len, dk = k32.shape
    dv = v32.shape[-1]
    state = _initial_state(initial_state, torch.Size(batch_heads), dk, dv, v32)

    outputs: list[torch.Tensor] = []
    states: list[torch.Tensor] = []
    for t in range(seq_len):
        q_t, k_t, v_t = q32[..., t, :], k32[..., t, :], v32[..., t, :]  # [..., H, d]
        state = state * g32[..., t].exp()[..., None, None]
        predicted_v = (state * k_t.unsqueeze(-1)).sum(-2)  # S^T k
        delta = (v_t - predicted_v) * beta32[..., t].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((state * q_t.unsqueeze(-1)).sum(-2))
        if return_all_states:
            states.append(state)

    # o: [..., T, H, dv]
    o = torch.stack(outputs, dim=-3) if outputs else v32.new_zeros(*v32.shape[:-3], 0, v32.shape[-3], dv)
    if not return_all_states:
        return o, state
    all_states = torch.stack(states, dim=-4) if states else v32.new_zeros(*o.shape[:-1], dk, dv)
    return o, state, all_states
