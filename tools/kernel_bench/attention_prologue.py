"""Time the attention prologue/epilogue kernels against the reference composition, as CUDA-graph replays.

    python3 -m tools.kernel_bench.attention_prologue

Ops (`ninfer.ops.triton.attention_prologue`): `qk_norm_rope_kv_write` against the reference
`split_q_gate` + q/k `rms_norm` + `apply_partial_rope` + `kv_write` of `attention_projection` /
`attention_mixer`, and `sigmoid_gate` against `gated_attention_output` on the gate view. Decode sizes
(N = 1, 8) are launch-bound, so both sides are captured in a CUDA graph and the replay is timed, as the
decode step runs them. One line per shape: the Triton median time, the bytes it must move and the GB/s,
the reference time, and the max relative error max|fast - ref| / max|ref|. A last line says whether
every error is within the bf16 bound. With OUT set, the rows also go to $OUT/attention_prologue.json.
"""

from __future__ import annotations

import torch

from ninfer.ops.attention import gated_attention_output, kv_write, split_q_gate
from ninfer.ops.norm import rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin
from ninfer.ops.triton.attention_prologue import qk_norm_rope_kv_write, sigmoid_gate
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us, timing_row

EPS = 1e-6
BF16 = torch.bfloat16
VARIANTS = {"27b": (24, 4), "35b-a3b": (16, 2)}  # (attention heads, kv heads)
HEAD_DIM, ROTARY_DIM, PAGE_SIZE, NUM_PAGES = 256, 64, 16, 64
DECODE_BATCHES = (1, 8)
DEVICE = "cuda"


def bench(variant: str, n: int, nh: int, nkv: int) -> list[dict[str, object]]:
    d = HEAD_DIM
    width = nh * 2 * d + 2 * nkv * d
    qkv = torch.randn(n, width, device=DEVICE).to(BF16)
    q_norm = (torch.randn(d, device=DEVICE) * 0.5).to(BF16)
    k_norm = (torch.randn(d, device=DEVICE) * 0.5).to(BF16)
    positions = torch.randint(0, 100_000, (n,), device=DEVICE).expand(3, n)
    cos, sin = mrope_cos_sin(positions, ROTARY_DIM, 1e7, (11, 11, 10))
    slots = torch.randperm(NUM_PAGES * PAGE_SIZE, device=DEVICE)[:n].to(torch.int32)
    pages_shape = (NUM_PAGES, PAGE_SIZE, nkv, d)
    k_pages, v_pages = (
        torch.zeros(pages_shape, dtype=BF16, device=DEVICE),
        torch.zeros(pages_shape, dtype=BF16, device=DEVICE),
    )
    k_pages_ref, v_pages_ref = torch.zeros_like(k_pages), torch.zeros_like(v_pages)
    o = torch.randn(n, nh, d, device=DEVICE).to(BF16)
    q_out = torch.empty(n, nh, d, dtype=BF16, device=DEVICE)
    gated = torch.empty(n, nh * d, dtype=BF16, device=DEVICE)
    ref_out: dict[str, torch.Tensor] = {}

    def fast_prologue() -> None:
        qk_norm_rope_kv_write(
            qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slots,
            num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=EPS, out=q_out,
        )  # fmt: skip

    def ref_prologue() -> None:  # attention_projection after its GEMM, then kv_write
        q_proj_out, k, v = qkv.split([nh * 2 * d, nkv * d, nkv * d], -1)
        q, gate = split_q_gate(q_proj_out, nh, d)
        ref_out["q"] = apply_partial_rope(rms_norm(q, q_norm, EPS), cos, sin)
        k = apply_partial_rope(rms_norm(k.reshape(n, nkv, d), k_norm, EPS), cos, sin)
        kv_write(k_pages_ref, v_pages_ref, k, v.reshape(n, nkv, d), slots)
        ref_out["gate"] = gate

    def fast_gate() -> None:
        sigmoid_gate(o, qkv, num_heads=nh, head_dim=d, out=gated)

    def ref_gate() -> None:
        ref_out["gated"] = gated_attention_output(o, split_q_gate(qkv[:, : nh * 2 * d], nh, d)[1])

    replays = {name: graphed(fn) for name, fn in [("fp", fast_prologue), ("rp", ref_prologue),
                                                  ("fg", fast_gate), ("rg", ref_gate)]}  # fmt: skip
    for replay in replays.values():
        replay()
    torch.cuda.synchronize()
    flat_slots = slots.long()
    prologue_error = max(
        max_rel_error(q_out, ref_out["q"]),
        max_rel_error(k_pages.view(-1, nkv, d)[flat_slots], k_pages_ref.view(-1, nkv, d)[flat_slots]),
        max_rel_error(v_pages.view(-1, nkv, d)[flat_slots], v_pages_ref.view(-1, nkv, d)[flat_slots]),
    )
    gate_error = max_rel_error(gated, ref_out["gated"])

    # bytes that must move: q/k/v read once (gate columns not), q and K/V written, cos/sin read
    prologue_bytes = 2 * n * (nh * d + 2 * nkv * d) * 2 + 2 * n * ROTARY_DIM * 4 + 2 * d * 2
    gate_bytes = 3 * n * nh * d * 2  # o and gate read, output written
    return [
        timing_row("qk_norm_rope_kv_write", variant, (n, nh, nkv, d), prologue_bytes,
             time_us(replays["fp"]), time_us(replays["rp"]), prologue_error, "torch(graph)"),
        timing_row("sigmoid_gate", variant, (n, nh, d), gate_bytes,
             time_us(replays["fg"]), time_us(replays["rg"]), gate_error, "torch(graph)"),
    ]  # fmt: skip


def main() -> None:
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    for variant, (nh, nkv) in VARIANTS.items():
        for n in DECODE_BATCHES:
            rows.extend(bench(variant, n, nh, nkv))
    finish("attention_prologue", rows)


if __name__ == "__main__":
    main()
