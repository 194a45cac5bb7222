"""Triton attention prologue/epilogue (`ninfer.ops.triton.attention_prologue`) against the reference ops.

The oracle is the reference composition of `attention_projection` (split_q_gate, rms_norm, partial RoPE)
+ `kv_write` and of `attention_mixer`'s `gated_attention_output`, plus one test through the model's own
`attention_projection`. CPU tests run the kernels in the Triton interpreter in a child process (fp32 and
fp16 at tiny shapes); `gpu` tests run the compiled kernels at the real 27B / 35B-A3B shapes in bf16 and
under CUDA-graph capture.
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops.attention import gated_attention_output, kv_write, split_q_gate
from ninfer.ops.norm import rms_norm
from ninfer.ops.rope import apply_partial_rope, mrope_cos_sin

torch.set_num_threads(1)

EPS = 1e-6
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.attention_prologue")


def _qkv(
    n: int, nh: int, nkv: int, d: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """A projection-like [N, nH*2D + 2*nKV*D] view whose row stride is wider than its width (offset 3)."""
    width = nh * 2 * d + 2 * nkv * d
    wide = (torch.randn(n, width + 7, generator=gen) * 2.0).to(dtype=dtype, device=device)
    return wide[:, 3 : 3 + width]


def _cos_sin(n: int, rotary_dim: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables for text positions (T = H = W), the model's interleaved M-RoPE with a 3-row section."""
    positions = torch.randint(0, 5000, (n,), generator=gen).expand(3, n)
    third = rotary_dim // 2 // 3
    section = (rotary_dim // 2 - 2 * third, third, third)
    return mrope_cos_sin(positions, rotary_dim, 1e7, section)


def _reference_projection(
    qkv: torch.Tensor,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    nh: int,
    nkv: int,
    d: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, gate, k, v exactly as `attention_projection` composes them after its GEMM."""
    n = qkv.shape[0]
    q_out, k, v = qkv.split([nh * 2 * d, nkv * d, nkv * d], -1)
    q, gate = split_q_gate(q_out, nh, d)
    k = k.reshape(n, nkv, d)
    v = v.reshape(n, nkv, d)
    q = apply_partial_rope(rms_norm(q, q_norm, EPS), cos, sin)
    k = apply_partial_rope(rms_norm(k, k_norm, EPS), cos, sin)
    return q, gate, k, v


def _pages(num_pages: int, page_size: int, nkv: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """K/V pages poisoned with NaN: any slot the kernel should not write stays NaN."""
    shape = (num_pages, page_size, nkv, d)
    return torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype)


def _flat(pages: torch.Tensor) -> torch.Tensor:
    return pages.view(-1, *pages.shape[2:])


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize(
    ("nh", "nkv", "d"), [(6, 1, 32), (8, 2, 32), (4, 2, 24)], ids=["6-1", "8-2", "odd-d"]
)
def test_qk_norm_rope_kv_write_matches_reference(
    kernels: ModuleType, n: int, nh: int, nkv: int, d: int
) -> None:
    gen = torch.Generator().manual_seed(100 * nh + n)
    rotary_dim, page_size, num_pages = 8, 4, 4
    qkv = _qkv(n, nh, nkv, d, torch.float32, gen)
    q_norm = torch.randn(d, generator=gen) * 0.5
    k_norm = torch.randn(d, generator=gen) * 0.5
    cos, sin = _cos_sin(n, rotary_dim, gen)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:n].to(torch.int32)  # out of order
    k_pages, v_pages = _pages(num_pages, page_size, nkv, d, torch.float32)
    q_ref, _, k_ref, v_ref = _reference_projection(qkv, q_norm, k_norm, cos, sin, nh, nkv, d)
    k_pages_ref, v_pages_ref = _pages(num_pages, page_size, nkv, d, torch.float32)
    kv_write(k_pages_ref, v_pages_ref, k_ref, v_ref, slots)
    qkv_before = qkv.clone()
    out = torch.full((n, nh, d), float("nan"))

    q = kernels.qk_norm_rope_kv_write(
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slots,
        num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=EPS, out=out,
    )  # fmt: skip

    assert q.data_ptr() == out.data_ptr()
    torch.testing.assert_close(q, q_ref, **CLOSE)
    written = slots.long()
    torch.testing.assert_close(_flat(k_pages)[written], k_ref, **CLOSE)
    assert torch.equal(_flat(v_pages)[written], v_ref), "v is copied, not computed"
    untouched = [s for s in range(num_pages * page_size) if s not in written.tolist()]
    assert _flat(k_pages)[untouched].isnan().all() and _flat(v_pages)[untouched].isnan().all()
    assert torch.equal(k_pages.isnan(), k_pages_ref.isnan()) and torch.equal(
        v_pages.isnan(), v_pages_ref.isnan()
    )
    assert torch.equal(qkv, qkv_before), "qkv (gate columns included) is read only"


def test_qk_norm_rope_kv_write_matches_the_reference_table(kernels: ModuleType) -> None:
    """Through the model's own `attention_qkv` (stacked and unstacked), against the reference table's
    prologue (rms_norm + apply_partial_rope + kv_write)."""
    from ninfer.targets.qwen3_6.kernels import REFERENCE
    from ninfer.targets.qwen3_6.model import attention_qkv
    from ninfer.targets.qwen3_6.variant import Variant
    from ninfer.targets.qwen3_6.view import AttentionLayerView

    nh, nkv, d, hidden, n = 8, 2, 32, 16, 5
    variant = Variant(
        hidden_size=hidden, num_layers=4, vocab_size=32, num_attention_heads=nh, num_kv_heads=nkv,
        head_dim=d, linear_num_key_heads=1, linear_num_value_heads=1, linear_key_head_dim=8,
        linear_value_head_dim=8, intermediate_size=8, mrope_section=(2, 1, 1),
    )  # fmt: skip
    gen = torch.Generator().manual_seed(5)
    q_proj = torch.randn(nh * 2 * d, hidden, generator=gen) * 0.3
    k_proj = torch.randn(nkv * d, hidden, generator=gen) * 0.3
    v_proj = torch.randn(nkv * d, hidden, generator=gen) * 0.3
    w = AttentionLayerView(
        q_proj=q_proj, k_proj=k_proj, v_proj=v_proj, o_proj=torch.zeros(hidden, nh * d),
        q_norm=torch.randn(d, generator=gen) * 0.5, k_norm=torch.randn(d, generator=gen) * 0.5,
        qkv_proj=torch.cat([q_proj, k_proj, v_proj]),
    )  # fmt: skip
    x = torch.randn(n, hidden, generator=gen)
    cos, sin = _cos_sin(n, variant.rotary_dim, gen)
    slots = torch.tensor([9, 2, 14, 3, 7])
    qkv = attention_qkv(w, x)
    unstacked = replace(w, qkv_proj=None)
    torch.testing.assert_close(attention_qkv(unstacked, x), qkv, **CLOSE)
    k_ref, v_ref = _pages(4, 4, nkv, d, torch.float32)
    q_ref = REFERENCE.attention_prologue(qkv, w.q_norm, w.k_norm, cos, sin, k_ref, v_ref, slots, variant)
    k_pages, v_pages = _pages(4, 4, nkv, d, torch.float32)
    q = kernels.qk_norm_rope_kv_write(
        qkv, w.q_norm, w.k_norm, cos, sin, k_pages, v_pages, slots,
        num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=variant.rms_norm_eps,
    )  # fmt: skip

    torch.testing.assert_close(q, q_ref, **CLOSE)
    torch.testing.assert_close(_flat(k_pages)[slots], _flat(k_ref)[slots], **CLOSE)
    torch.testing.assert_close(_flat(v_pages)[slots], _flat(v_ref)[slots], **CLOSE)
    assert not _flat(k_ref)[slots].isnan().any() and not _flat(v_ref)[slots].isnan().any()
    untouched = torch.ones(_flat(k_pages).shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert _flat(k_pages)[untouched].isnan().all() and _flat(v_pages)[untouched].isnan().all()


def _ulp_mismatch(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(largest |got - want| in units of want's ulp, fraction of elements that differ at all)."""
    finfo = torch.finfo(want.dtype)
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(finfo.tiny)))) * finfo.eps
    diff = (got.float() - want.float()).abs()
    return (diff / ulp).max().item(), (diff > 0).float().mean().item()


def test_qk_norm_rope_kv_write_fp16_rounding(kernels: ModuleType) -> None:
    """fp16 model dtype: q within one ulp of the reference (nearly all bit-equal), v bit-equal.

    The k pages are fp32 here, so they show whether k was rounded to the model dtype before the cast to
    the page dtype (as `attention_projection` then `kv_write` round it): every value must be fp16-exact.
    """
    gen = torch.Generator().manual_seed(16)
    n, nh, nkv, d, rotary_dim = 5, 8, 2, 32, 8
    qkv = _qkv(n, nh, nkv, d, torch.float16, gen)
    q_norm = (torch.randn(d, generator=gen) * 0.5).half()
    k_norm = (torch.randn(d, generator=gen) * 0.5).half()
    cos, sin = _cos_sin(n, rotary_dim, gen)
    slots = torch.tensor([6, 0, 11, 5, 13], dtype=torch.int64)
    k_pages, v_pages = _pages(4, 4, nkv, d, torch.float32)
    q_ref, _, k_ref, v_ref = _reference_projection(qkv, q_norm, k_norm, cos, sin, nh, nkv, d)

    q = kernels.qk_norm_rope_kv_write(
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slots,
        num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=EPS,
    )  # fmt: skip

    assert q.dtype == torch.float16
    for got, want in ((q, q_ref), (_flat(k_pages)[slots].half(), k_ref)):
        worst_ulps, differing = _ulp_mismatch(got, want)
        assert worst_ulps <= 1.0 and differing < 0.02, (worst_ulps, differing)
    k_written = _flat(k_pages)[slots]
    assert torch.equal(k_written, k_written.half().float()), "k must be rounded to fp16 before the page cast"
    assert torch.equal(_flat(v_pages)[slots], v_ref.float())


def test_qk_norm_rope_kv_write_skips_negative_slots(kernels: ModuleType) -> None:
    """A padding token (slot -1) writes no K/V; its q is still computed; other pages keep their values."""
    gen = torch.Generator().manual_seed(8)
    n, nh, nkv, d, rotary_dim = 3, 6, 1, 32, 8
    qkv = _qkv(n, nh, nkv, d, torch.float32, gen)
    q_norm, k_norm = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
    cos, sin = _cos_sin(n, rotary_dim, gen)
    slots = torch.tensor([4, -1, 1], dtype=torch.int32)
    k_pages = torch.randn(2, 4, nkv, d, generator=gen)
    v_pages = torch.randn(2, 4, nkv, d, generator=gen)
    k_before, v_before = k_pages.clone(), v_pages.clone()
    q_ref, _, k_ref, v_ref = _reference_projection(qkv, q_norm, k_norm, cos, sin, nh, nkv, d)

    q = kernels.qk_norm_rope_kv_write(
        qkv, q_norm, k_norm, cos, sin, k_pages, v_pages, slots,
        num_heads=nh, num_kv_heads=nkv, head_dim=d, eps=EPS,
    )  # fmt: skip

    torch.testing.assert_close(q, q_ref, **CLOSE)
    torch.testing.assert_close(_flat(k_pages)[[4, 1]], k_ref[[0, 2]], **CLOSE)
    assert torch.equal(_flat(v_pages)[[4, 1]], v_ref[[0, 2]])
    kept = [0, 2, 3, 5, 6, 7]
    assert torch.equal(_flat(k_pages)[kept], _flat(k_before)[kept])
    assert torch.equal(_flat(v_pages)[kept], _flat(v_before)[kept])


def test_qk_norm_rope_kv_write_rejects_bad_shapes(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = _qkv(2, 2, 1, 16, torch.float32, gen)
    norm = torch.zeros(16)
    cos, sin = _cos_sin(2, 8, gen)
    k_pages, v_pages = _pages(2, 4, 1, 16, torch.float32)
    slots = torch.tensor([0, 1])
    common = {"num_heads": 2, "num_kv_heads": 1, "head_dim": 16, "eps": EPS}
    with pytest.raises(ValueError, match="qkv"):
        kernels.qk_norm_rope_kv_write(qkv[:, :-1], norm, norm, cos, sin, k_pages, v_pages, slots, **common)
    with pytest.raises(ValueError, match="k_pages"):
        kernels.qk_norm_rope_kv_write(qkv, norm, norm, cos, sin, k_pages[..., :8], v_pages, slots, **common)
    with pytest.raises(ValueError, match="cos"):
        kernels.qk_norm_rope_kv_write(qkv, norm, norm, cos[:1], sin[:1], k_pages, v_pages, slots, **common)


@pytest.mark.parametrize("n", [1, 5])
@pytest.mark.parametrize(
    ("nh", "nkv", "d"), [(6, 1, 32), (8, 2, 32), (8, 1, 160)], ids=["6-1", "8-2", "2-blocks"]
)
def test_sigmoid_gate_matches_reference(kernels: ModuleType, n: int, nh: int, nkv: int, d: int) -> None:
    """o strided (a head slice of a wider buffer), gate read in place; 8 x 160 spans two programs."""
    gen = torch.Generator().manual_seed(10 * nh + n)
    qkv = _qkv(n, nh, nkv, d, torch.float32, gen)
    o = torch.randn(n, nh + 1, d, generator=gen)[:, 1:]
    _, gate = split_q_gate(qkv[:, : nh * 2 * d], nh, d)
    want = gated_attention_output(o, gate)
    out = torch.full((n, nh * d), float("nan"))

    got = kernels.sigmoid_gate(o, qkv, num_heads=nh, head_dim=d, out=out)

    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got, want, **CLOSE)


def test_sigmoid_gate_fp16_rounding(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(3)
    n, nh, nkv, d = 5, 8, 2, 32
    qkv = _qkv(n, nh, nkv, d, torch.float16, gen)
    o = torch.randn(n, nh, d, generator=gen).half()
    want = gated_attention_output(o, split_q_gate(qkv[:, : nh * 2 * d], nh, d)[1])

    got = kernels.sigmoid_gate(o, qkv, num_heads=nh, head_dim=d)

    assert got.dtype == torch.float16
    worst_ulps, differing = _ulp_mismatch(got, want)
    assert worst_ulps <= 1.0 and differing < 0.02, (worst_ulps, differing)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
VARIANTS = {"27b": (24, 4), "35b-a3b": (16, 2)}  # (attention heads, kv heads); D = 256, rotary 64
D, ROTARY, PAGE_SIZE, BF16_BOUND = 256, 64, 16, 1e-2


def _gpu_case(n: int, nh: int, nkv: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 * n + 3
    cos, sin = _cos_sin(n, ROTARY, gen)
    qkv = _qkv(n, nh, nkv, D, torch.bfloat16, gen, device="cuda")  # strided: built on the device
    case = {
        "q_norm": (torch.randn(D, generator=gen) * 0.5).bfloat16(),
        "k_norm": (torch.randn(D, generator=gen) * 0.5).bfloat16(),
        "cos": cos,
        "sin": sin,
        "slots": torch.randperm(num_pages * PAGE_SIZE, generator=gen)[:n].to(torch.int32),
        "o": torch.randn(n, nh, D, generator=gen).bfloat16(),
    }
    return {"qkv": qkv, **{name: t.cuda() for name, t in case.items()}}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n", [1, 3, 8])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_prologue_cuda_real_shapes(n: int, variant: str) -> None:
    from ninfer.ops.triton.attention_prologue import qk_norm_rope_kv_write, sigmoid_gate

    nh, nkv = VARIANTS[variant]
    x = _gpu_case(n, nh, nkv, seed=n * 7 + nh)
    num_pages = 2 * n + 3
    q_ref, gate_ref, k_ref, v_ref = _reference_projection(
        x["qkv"], x["q_norm"], x["k_norm"], x["cos"], x["sin"], nh, nkv, D
    )
    k_pages = torch.full((num_pages, PAGE_SIZE, nkv, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    v_pages = torch.full_like(k_pages, float("nan"))
    out = torch.full((n, nh, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    qkv_before = x["qkv"].clone()

    q = qk_norm_rope_kv_write(
        x["qkv"], x["q_norm"], x["k_norm"], x["cos"], x["sin"], k_pages, v_pages, x["slots"],
        num_heads=nh, num_kv_heads=nkv, head_dim=D, eps=EPS, out=out,
    )  # fmt: skip
    torch.cuda.synchronize()

    slots = x["slots"].long()
    assert not q.isnan().any()
    assert max_rel_error(q, q_ref) < BF16_BOUND
    assert max_rel_error(_flat(k_pages)[slots], k_ref) < BF16_BOUND
    assert not _flat(k_pages)[slots].isnan().any()
    # the same rounding steps as the reference: all but a few elements bit-equal (FMA contraction and
    # the reduction order of 1/rms can flip a rare last bf16 bit)
    assert (q != q_ref).float().mean().item() < 0.02
    assert torch.equal(_flat(v_pages)[slots], v_ref)
    poisoned = torch.ones(num_pages * PAGE_SIZE, dtype=torch.bool, device="cuda")
    poisoned[slots] = False
    assert _flat(k_pages)[poisoned].isnan().all() and _flat(v_pages)[poisoned].isnan().all()
    assert torch.equal(x["qkv"], qkv_before)

    gated = torch.full((n, nh * D), float("nan"), dtype=torch.bfloat16, device="cuda")
    sigmoid_gate(x["o"], x["qkv"], num_heads=nh, head_dim=D, out=gated)
    want = gated_attention_output(x["o"], gate_ref)
    assert not gated.isnan().any()
    assert max_rel_error(gated, want) < BF16_BOUND
    assert (gated != want).float().mean().item() < 0.02


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_prologue_cuda_graph_replay(variant: str) -> None:
    """Both kernels captured in one CUDA graph, replayed on new inputs copied into the static buffers."""
    from ninfer.ops.triton.attention_prologue import qk_norm_rope_kv_write, sigmoid_gate

    nh, nkv, n = *VARIANTS[variant], 8
    static = _gpu_case(n, nh, nkv, seed=1)
    num_pages = 2 * n + 3
    k_pages = torch.zeros((num_pages, PAGE_SIZE, nkv, D), dtype=torch.bfloat16, device="cuda")
    v_pages = torch.zeros_like(k_pages)
    q_out = torch.empty((n, nh, D), dtype=torch.bfloat16, device="cuda")
    gated = torch.empty((n, nh * D), dtype=torch.bfloat16, device="cuda")

    def step() -> None:
        qk_norm_rope_kv_write(
            static["qkv"], static["q_norm"], static["k_norm"], static["cos"], static["sin"], k_pages,
            v_pages, static["slots"], num_heads=nh, num_kv_heads=nkv, head_dim=D, eps=EPS, out=q_out,
        )  # fmt: skip
        sigmoid_gate(static["o"], static["qkv"], num_heads=nh, head_dim=D, out=gated)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()

    fresh = _gpu_case(n, nh, nkv, seed=2)
    for name, t in fresh.items():
        static[name].copy_(t)
    k_pages.fill_(float("nan"))
    v_pages.fill_(float("nan"))
    q_out.fill_(float("nan"))
    gated.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()

    q_ref, gate_ref, k_ref, v_ref = _reference_projection(
        fresh["qkv"], fresh["q_norm"], fresh["k_norm"], fresh["cos"], fresh["sin"], nh, nkv, D
    )
    slots = fresh["slots"].long()
    assert not q_out.isnan().any() and not gated.isnan().any()
    assert max_rel_error(q_out, q_ref) < BF16_BOUND
    assert max_rel_error(_flat(k_pages)[slots], k_ref) < BF16_BOUND
    assert torch.equal(_flat(v_pages)[slots], v_ref)
    assert max_rel_error(gated, gated_attention_output(fresh["o"], gate_ref)) < BF16_BOUND
