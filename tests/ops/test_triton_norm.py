"""Triton norms (`ninfer.ops.triton.norm`) against the reference `ninfer.ops.norm` ops.

CPU tests run the kernels in the Triton interpreter child (fp32, plus one fp16 case for the cast order
of the gated norm, at tiny shapes); `gpu` tests run them compiled at the real shapes in bf16.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, max_rel_error, run_interpreter_child

from ninfer.ops import norm as reference

torch.set_num_threads(1)
EPS = 1e-6
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.norm")


def _randn(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * scale


def _assert_same_roundings(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp16 results: a missing or extra rounding step flips about a quarter of the elements by one ulp;
    the fp32 summation order may flip a rare one, so allow 1% (and only small differences)."""
    mismatches = (got != want).sum().item()
    assert mismatches <= want.numel() // 100, f"{mismatches} of {want.numel()} differ"
    assert max_rel_error(got, want) < 2e-3


@pytest.mark.parametrize(
    "shape",
    [(1, 48), (7, 48), (300, 16), (5, 3, 24)],
    ids=["one-row", "odd-rows", "packed-short-rows", "heads"],
)
def test_rms_norm_matches_reference(kernels: ModuleType, shape: tuple[int, ...]) -> None:
    """48 and 24 are not powers of two (masked tail); 300 rows of 16 go two to a program."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = _randn(*shape, gen=gen, scale=3.0)
    weight = _randn(shape[-1], gen=gen, scale=0.5)  # random: a w vs 1 + w slip shows
    out = torch.full(shape, float("nan"))

    y = kernels.rms_norm(x, weight, EPS, out=out)

    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, reference.rms_norm(x, weight, EPS), **CLOSE)


def test_norms_pack_short_rows_with_a_ragged_last_program(
    kernels: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Few programs wanted: 37 rows of 12 go 32 to a program, the second program holds 5 real rows."""
    monkeypatch.setattr(kernels, "_TARGET_PROGRAMS", 2)
    assert kernels._launch(37, 12)[:3] == (32, 16, 2)
    gen = torch.Generator().manual_seed(4)
    x, z = _randn(37, 12, gen=gen, scale=3.0), _randn(37, 12, gen=gen)
    mixed = _randn(37, 12, gen=gen)
    weight = _randn(12, gen=gen, scale=0.5)

    torch.testing.assert_close(kernels.rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS), **CLOSE)
    normed, summed = kernels.add_rms_norm(x, mixed, weight, EPS)
    torch.testing.assert_close(normed, reference.rms_norm(x + mixed, weight, EPS), **CLOSE)
    assert torch.equal(summed, x + mixed)
    gated = kernels.gated_rms_norm(x, weight, z, EPS)
    torch.testing.assert_close(gated, reference.gated_rms_norm(x, weight, z, EPS), **CLOSE)


def test_rms_norm_strided_heads_of_interleaved_projection(kernels: ModuleType) -> None:
    """q [T, heads, D] sliced from the per-head interleaved q/gate output, as attention_projection does."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, head_dim = 5, 3, 20
    proj = _randn(tokens, heads, 2 * head_dim, gen=gen)
    q = proj[..., :head_dim]
    weight = _randn(head_dim, gen=gen, scale=0.5)

    y = kernels.rms_norm(q, weight, EPS)

    assert y.shape == q.shape and y.is_contiguous()
    torch.testing.assert_close(y, reference.rms_norm(q, weight, EPS), **CLOSE)
    # a view whose leading dims do not collapse (transposed tokens/heads) takes the copy path
    qt = q.transpose(0, 1)
    torch.testing.assert_close(
        kernels.rms_norm(qt, weight, EPS), reference.rms_norm(qt, weight, EPS), **CLOSE
    )


@pytest.mark.parametrize("rows", [1, 9])
def test_add_rms_norm_matches_add_then_reference(kernels: ModuleType, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n = 40
    x = _randn(rows, n, gen=gen, scale=2.0)
    mixed = _randn(rows, n, gen=gen)
    weight = _randn(n, gen=gen, scale=0.5)
    summed_ref = x + mixed
    normed_ref = reference.rms_norm(summed_ref, weight, EPS)

    normed, summed = kernels.add_rms_norm(x, mixed, weight, EPS)

    torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)
    torch.testing.assert_close(normed, normed_ref, **CLOSE)


def test_add_rms_norm_in_place_residual_and_strided_input(kernels: ModuleType) -> None:
    gen = torch.Generator().manual_seed(11)
    rows, n = 6, 24
    x = _randn(rows, n, gen=gen)
    wide = _randn(rows, n + 8, gen=gen)
    mixed = wide[:, 4 : 4 + n]  # a strided mixer output
    weight = _randn(n, gen=gen, scale=0.5)
    summed_ref = x + mixed
    normed_ref = reference.rms_norm(summed_ref, weight, EPS)

    normed, summed = kernels.add_rms_norm(x, mixed, weight, EPS, summed_out=x)

    assert summed.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, summed_ref, rtol=0, atol=0)
    torch.testing.assert_close(normed, normed_ref, **CLOSE)


def test_add_rms_norm_rounds_the_sum_like_torch(kernels: ModuleType) -> None:
    """fp16: the sum is rounded to fp16 before the norm reads it, exactly as `x + residual` is."""
    gen = torch.Generator().manual_seed(12)
    rows, n = 16, 24
    x = _randn(rows, n, gen=gen, scale=8.0).half()
    mixed = (_randn(rows, n, gen=gen) * 1e-2).half()  # small addends: the rounding of the sum matters
    weight = _randn(n, gen=gen, scale=0.5).half()
    summed_ref = x + mixed

    normed, summed = kernels.add_rms_norm(x, mixed, weight, EPS)

    assert summed.dtype == normed.dtype == torch.float16
    assert torch.equal(summed, summed_ref)
    _assert_same_roundings(normed, reference.rms_norm(summed_ref, weight, EPS))


@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 9])
def test_add_rms_norm_partials_equals_reduce_then_add_rms_norm(
    kernels: ModuleType, splits: int, rows: int
) -> None:
    """fp16 residual, fp32 slabs: the slab-order fp32 sum rounded to fp16, then the add and the norm, bit
    for bit as `add_rms_norm` on that rounded sum; one slab is the projection itself, in fp16."""
    gen = torch.Generator().manual_seed(splits * 10 + rows)
    n = 40
    residual = _randn(rows, n, gen=gen, scale=4.0).half()
    weight = _randn(n, gen=gen, scale=0.5).half()
    partials = _randn(splits, rows, n, gen=gen)
    if splits == 1:
        partials = partials.half()
    reduced = partials[0].float().clone()
    for slab in partials[1:]:
        reduced += slab
    want_normed, want_summed = kernels.add_rms_norm(reduced.half(), residual, weight, EPS)
    out = torch.full_like(residual, float("nan"))

    normed, summed = kernels.add_rms_norm_partials(partials, residual, weight, EPS, out=out)

    assert normed.data_ptr() == out.data_ptr() and summed.dtype == torch.float16
    assert torch.equal(summed, want_summed) and torch.equal(normed, want_normed)


@pytest.mark.parametrize("splits", [0, 1, 3], ids=["add", "one-slab", "three-slabs"])
@pytest.mark.parametrize("rows", [1, 9])
def test_settled_loads_and_early_launch_give_the_same_bits(
    kernels: ModuleType, splits: int, rows: int
) -> None:
    """settled (weight and residual loaded before the PDL wait) and launch_next_early change when the kernel
    reads, not what it computes: the same normed and summed rows, bit for bit, for every norm."""
    gen = torch.Generator().manual_seed(20 + splits * 10 + rows)
    n = 40
    residual = _randn(rows, n, gen=gen, scale=4.0).half()
    weight = _randn(n, gen=gen, scale=0.5).half()
    flags = {"settled": True, "launch_next_early": True}
    if splits:
        partials = _randn(splits, rows, n, gen=gen)
        partials = partials if splits > 1 else partials.half()
        want = kernels.add_rms_norm_partials(partials, residual, weight, EPS)
        got = kernels.add_rms_norm_partials(partials, residual, weight, EPS, **flags)
    else:
        x = _randn(rows, n, gen=gen).half()
        want = (*kernels.add_rms_norm(x, residual, weight, EPS), kernels.rms_norm(x, weight, EPS))
        got = (
            *kernels.add_rms_norm(x, residual, weight, EPS, **flags),
            kernels.rms_norm(x, weight, EPS, **flags),
        )
        o, z = _randn(rows, 3, 16, gen=gen), _randn(rows, 3, 16, gen=gen).half()
        gated_weight = _randn(16, gen=gen).half()
        want += (kernels.gated_rms_norm(o, gated_weight, z, EPS),)
        got += (kernels.gated_rms_norm(o, gated_weight, z, EPS, launch_next_early=True),)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_add_rms_norm_partials_rejects_bad_slabs(kernels: ModuleType) -> None:
    residual, weight = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(ValueError, match="partials must be"):
        kernels.add_rms_norm_partials(torch.randn(2, 3, 8), residual, weight, EPS)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.add_rms_norm_partials(
            torch.randn(2, 8, 2).transpose(1, 2).transpose(0, 1), residual, weight, EPS
        )
    with pytest.raises(ValueError, match="fp32"):
        kernels.add_rms_norm_partials(torch.randn(2, 2, 8).half(), residual, weight, EPS)


@pytest.mark.parametrize("shape", [(1, 3, 16), (5, 3, 24)], ids=["one-token", "odd-tokens"])
def test_gated_rms_norm_matches_reference(kernels: ModuleType, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    x = _randn(*shape, gen=gen, scale=2.0)
    z = _randn(*shape, gen=gen, scale=2.0)
    weight = 1 + _randn(shape[-1], gen=gen, scale=0.5)
    out = torch.full(shape, float("nan"))

    y = kernels.gated_rms_norm(x, weight, z, EPS, out=out)

    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, reference.gated_rms_norm(x, weight, z, EPS), **CLOSE)
    plain = reference.rms_norm(x, weight - 1, EPS) * torch.nn.functional.silu(z)
    assert torch.allclose(y, plain, atol=1e-4), "gated norm: plain weight times silu(z)"


def test_gated_rms_norm_casts_fp32_input_to_z_dtype(kernels: ModuleType) -> None:
    """fp32 recurrence output, fp16 z and weight: = the reference on x.to(z.dtype), output in z's dtype."""
    gen = torch.Generator().manual_seed(21)
    shape = (16, 2, 24)
    x = _randn(*shape, gen=gen, scale=2.0)
    wide_z = _randn(16, 2 * 24 * 2, gen=gen).half()
    z = wide_z[:, 8 : 8 + 48].view(shape)  # a strided z
    weight = (1 + _randn(24, gen=gen, scale=0.5)).half()

    y = kernels.gated_rms_norm(x, weight, z, EPS)

    assert y.dtype == torch.float16
    _assert_same_roundings(y, reference.gated_rms_norm(x.half(), weight, z, EPS))


def test_norms_reject_bad_weight(kernels: ModuleType) -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(x, torch.zeros(7), EPS)
    with pytest.raises(ValueError, match="weight"):
        kernels.gated_rms_norm(x, torch.zeros(9), x, EPS)


# ---- GPU, real shapes ----------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
BF16_BOUND = 1e-2
ROWS = [1, 7, 4096]


def _assert_close_bf16(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within the bf16 bound, and bit-identical almost everywhere: the kernels round at the same steps
    as the reference, so only fp32 reduction-order noise may flip an element's last bf16 bit."""
    assert not got.isnan().any()
    assert max_rel_error(got, want) < BF16_BOUND
    mismatches = (got != want).sum().item()
    assert mismatches <= want.numel() // 100, f"{mismatches} of {want.numel()} differ"


def _cuda_inputs(seed: int, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen) * 2).to(torch.bfloat16).cuda() for shape in shapes]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", [5120, 2048])
def test_rms_norm_and_add_rms_norm_cuda_hidden(rows: int, hidden: int) -> None:
    from ninfer.ops.triton.norm import add_rms_norm, rms_norm

    x, mixed, weight = _cuda_inputs(rows + hidden, (rows, hidden), (rows, hidden), (hidden,))
    out = torch.full_like(x, float("nan"))
    _assert_close_bf16(rms_norm(x, weight, EPS, out=out), reference.rms_norm(x, weight, EPS))

    normed_out, summed_out = torch.full_like(x, float("nan")), torch.full_like(x, float("nan"))
    normed, summed = add_rms_norm(x, mixed, weight, EPS, out=normed_out, summed_out=summed_out)
    assert torch.equal(summed, x + mixed), "the bf16 sum must round exactly like torch's add"
    _assert_close_bf16(normed, reference.rms_norm(x + mixed, weight, EPS))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize(("heads", "kv_heads"), [(24, 4), (16, 2)], ids=["27b", "35b-a3b"])
def test_rms_norm_cuda_qk_heads(rows: int, heads: int, kv_heads: int) -> None:
    """q [T, heads, 256] as the strided slice of the interleaved q/gate projection; k contiguous."""
    from ninfer.ops.triton.norm import rms_norm

    head_dim = 256
    proj, k, q_weight, k_weight = _cuda_inputs(
        rows * heads, (rows, heads, 2 * head_dim), (rows, kv_heads, head_dim), (head_dim,), (head_dim,)
    )
    q = proj[..., :head_dim]
    for x, weight in ((q, q_weight), (k, k_weight)):
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device="cuda")
        _assert_close_bf16(rms_norm(x, weight, EPS, out=out), reference.rms_norm(x, weight, EPS))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("value_heads", [48, 32], ids=["27b", "35b-a3b"])
def test_gated_rms_norm_cuda_gdn_output(rows: int, value_heads: int) -> None:
    """o fp32 [T, nv, 128] from the recurrence, z bf16 (a view of in_proj_z's output), weight bf16."""
    from ninfer.ops.triton.norm import gated_rms_norm

    dv = 128
    o32 = torch.randn(
        rows, value_heads, dv, generator=torch.Generator().manual_seed(rows), device="cpu"
    ).cuda()
    z, weight = _cuda_inputs(rows + value_heads, (rows, value_heads * dv), (dv,))
    z = z.view(rows, value_heads, dv)
    weight = weight.abs() * 0.5 + 0.5
    want = reference.gated_rms_norm(o32.to(z.dtype), weight, z, EPS)  # as model.gdn_output does it

    out = torch.full(z.shape, float("nan"), dtype=z.dtype, device="cuda")
    y = gated_rms_norm(o32, weight, z, EPS, out=out)
    assert y.dtype == torch.bfloat16
    _assert_close_bf16(y, want)

    out.fill_(float("nan"))
    o16 = o32.to(torch.bfloat16)
    y = gated_rms_norm(o16, weight, z, EPS, out=out)
    _assert_close_bf16(y, want)
