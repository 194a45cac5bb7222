# ruff: noqa: B023  (every lambda is timed inside its own loop iteration)
"""Probe fla-core's prefill kernels (chunk gated delta rule, causal conv1d) and SDPA prefill attention on
the GPU: correctness against the reference ops and time at the real shapes.

    python3 -m tools.kernel_bench.fla_prefill
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from ninfer.ops.conv import causal_conv1d
from ninfer.ops.gated_delta import chunk_gated_delta_rule, gdn_gating
from tools.kernel_bench.common import time_us


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    from fla.modules.convolution import causal_conv1d as fla_conv
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    dev = torch.device("cuda")
    rows: list[dict] = []
    gen = torch.Generator(device=dev).manual_seed(0)
    for name, nk, nv in (("27b", 16, 48), ("35b", 16, 32)):
        dk = dv = 128
        lens = [37, 300, 1000]
        T = sum(lens)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        q = torch.randn(1, T, nk, dk, device=dev, generator=gen).bfloat16()
        k = torch.randn(1, T, nk, dk, device=dev, generator=gen).bfloat16()
        v = torch.randn(1, T, nv, dv, device=dev, generator=gen).bfloat16()
        a = torch.randn(1, T, nv, device=dev, generator=gen).bfloat16()
        b = torch.randn(1, T, nv, device=dev, generator=gen).bfloat16()
        A_log = torch.rand(nv, device=dev, generator=gen) * 2.7
        dt_bias = torch.randn(nv, device=dev, generator=gen) * 0.5
        g, beta = gdn_gating(a, b, A_log, dt_bias)
        h0 = torch.randn(len(lens), nv, dk, dv, device=dev, generator=gen) * 0.1
        o, ht = fla_chunk(
            q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu, cu_seqlens_cpu=cu.cpu(),
        )  # fmt: skip
        errs_o, errs_h = [], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            rep = nv // nk
            ro, rh = chunk_gated_delta_rule(
                q[0, s:e].repeat_interleave(rep, 1), k[0, s:e].repeat_interleave(rep, 1), v[0, s:e],
                g[0, s:e], beta[0, s:e], h0[i],
            )  # fmt: skip
            errs_o.append(rel(o[0, s:e], ro))
            errs_h.append(rel(ht[i], rh))
        row = {"op": "fla_chunk_varlen_check", "shape": name, "rel_o": max(errs_o), "rel_state": max(errs_h)}
        print(row, flush=True)
        rows.append(row)
        for T in (2048, 8192):
            q1 = torch.randn(1, T, nk, dk, device=dev, generator=gen).bfloat16()
            k1 = torch.randn(1, T, nk, dk, device=dev, generator=gen).bfloat16()
            v1 = torch.randn(1, T, nv, dv, device=dev, generator=gen).bfloat16()
            g1 = -torch.rand(1, T, nv, device=dev, generator=gen)
            b1 = torch.rand(1, T, nv, device=dev, generator=gen)
            cu1 = torch.tensor([0, T], dtype=torch.int32, device=dev)
            h1 = torch.zeros(1, nv, dk, dv, device=dev)
            us = time_us(
                lambda q1=q1, k1=k1, v1=v1, g1=g1, b1=b1, cu1=cu1, h1=h1: fla_chunk(
                    q1, k1, v1, g1, b1, initial_state=h1, output_final_state=True,
                    use_qk_l2norm_in_kernel=True, cu_seqlens=cu1, cu_seqlens_cpu=cu1.cpu(),
                )
            )  # fmt: skip
            row = {"op": "fla_chunk", "shape": name, "T": T, "us": us}
            print(row, flush=True)
            rows.append(row)
        # conv: varlen with initial states vs the reference per row
        C = 2 * nk * dk + nv * dv
        x = torch.randn(1, sum(lens), C, device=dev, generator=gen).bfloat16()
        w = torch.randn(C, 4, device=dev, generator=gen).bfloat16() * 0.5
        init = torch.randn(len(lens), C, 3, device=dev, generator=gen).bfloat16()
        # fla's conv state is the full kernel width K, right-aligned: pad ours (K-1) with a zero column
        y, fin = fla_conv(
            x, w, initial_state=F.pad(init, (1, 0)), output_final_state=True, activation="silu", cu_seqlens=cu
        )
        fin = fin[..., 1:]
        errs, errs_s = [], []
        for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            ry, rs = causal_conv1d(x[0, s:e], w, init[i])
            errs.append(rel(y[0, s:e], ry))
            errs_s.append(rel(fin[i], rs))
        row = {"op": "fla_conv_varlen_check", "shape": name, "rel_y": max(errs), "rel_state": max(errs_s),
               "final_state_shape": list(fin.shape)}  # fmt: skip
        print(row, flush=True)
        rows.append(row)
        x8 = torch.randn(1, 8192, C, device=dev, generator=gen).bfloat16()
        cu8 = torch.tensor([0, 8192], dtype=torch.int32, device=dev)
        z8 = torch.zeros(1, C, 4, device=dev, dtype=torch.bfloat16)
        us = time_us(lambda: fla_conv(x8, w, initial_state=z8, output_final_state=True, activation="silu",
                                    cu_seqlens=cu8))  # fmt: skip
        rows.append({"op": "fla_conv", "shape": name, "T": 8192, "us": us})
        print(rows[-1], flush=True)
    # SDPA prefill attention (flash) at head_dim 256: 27B 24/4 heads, 35B 16/2
    for name, nh, nkv in (("27b", 24, 4), ("35b", 16, 2)):
        for T in (2048, 8192):
            qq = torch.randn(1, nh, T, 256, device=dev, generator=gen).bfloat16()
            kk = torch.randn(1, nkv, T, 256, device=dev, generator=gen).bfloat16()
            vv = torch.randn(1, nkv, T, 256, device=dev, generator=gen).bfloat16()
            us = time_us(lambda qq=qq, kk=kk, vv=vv: F.scaled_dot_product_attention(
                qq, kk, vv, is_causal=True, enable_gqa=True))  # fmt: skip
            flop = 2 * 2 * nh * 256 * T * T / 2
            rows.append({"op": "sdpa_causal", "shape": name, "T": T, "us": us, "TFLOPs": flop / us / 1e6})
            print(rows[-1], flush=True)
    # a later prompt chunk: 2048 queries at the end of an 8192-token context (bottom-right causal)
    from torch.nn.attention.bias import causal_lower_right

    for name, nh, nkv in (("27b", 24, 4), ("35b", 16, 2)):
        M, L = 2048, 8192
        qq = torch.randn(1, nh, M, 256, device=dev, generator=gen).bfloat16()
        kk = torch.randn(1, nkv, L, 256, device=dev, generator=gen).bfloat16()
        vv = torch.randn(1, nkv, L, 256, device=dev, generator=gen).bfloat16()
        ke, ve = kk.repeat_interleave(nh // nkv, 1), vv.repeat_interleave(nh // nkv, 1)
        bias = causal_lower_right(M, L)
        dense = torch.ones(M, L, dtype=torch.bool, device=dev).tril(L - M)
        ref = F.scaled_dot_product_attention(qq.float(), ke.float(), ve.float(), attn_mask=dense)
        for label, fn in (
            ("lower_right_bias", lambda: F.scaled_dot_product_attention(qq, ke, ve, attn_mask=bias)),
            ("bool_mask", lambda: F.scaled_dot_product_attention(qq, ke, ve, attn_mask=dense)),
        ):
            try:
                err = rel(fn(), ref)
                us = time_us(fn)
                rows.append(
                    {"op": f"sdpa_chunk_{label}", "shape": name, "M": M, "L": L, "us": us, "rel": err}
                )
            except Exception as e:  # noqa: BLE001 - a probe: report what fails
                rows.append({"op": f"sdpa_chunk_{label}", "shape": name, "error": repr(e)[:300]})
            print(rows[-1], flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fla_prefill.json"), "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
