"""Time the decode-path small Triton ops against the reference torch ops, at the real Qwen3.6 shapes.

    python3 -m tools.kernel_bench.small_ops

Ops: the conv decode step over the slot pool (`ninfer.ops.triton.conv_update`; the reference is the
model's gather + where + `causal_conv1d_update` + `index_copy_`), and the norms of `ninfer.ops.triton.norm`
(hidden rms_norm, add_rms_norm, q/k head rms_norm on the strided q slice, GDN gated_rms_norm on the fp32
recurrence output). One line per shape: the Triton median time, the bytes it must move and the GB/s,
the reference time, and the max relative error max|fast - ref| / max|ref|. A last line says whether
every error is within the bf16 bound. With OUT set, the rows also go to $OUT/small_ops.json.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ninfer.ops import norm as reference
from ninfer.ops.attention import paged_decode_attention as reference_decode_attention
from ninfer.ops.conv import causal_conv1d_update
from ninfer.ops.triton.conv_update import causal_conv1d_update_slots
from ninfer.ops.triton.norm import add_rms_norm, gated_rms_norm, rms_norm
from ninfer.ops.triton.paged_decode_attention import default_num_splits, paged_decode_attention
from tools.kernel_bench.common import finish, graphed, max_rel_error, time_us, timing_row

EPS = 1e-6
BF16 = torch.bfloat16
VARIANTS = {  # name: (hidden, conv_dim, attention heads, kv heads, GDN value heads)
    "27b": (5120, 10240, 24, 4, 48),
    "35b-a3b": (2048, 8192, 16, 2, 32),
}
DECODE_BATCHES = (1, 8)
NORM_ROWS = (1, 8, 8192)
DEVICE = "cuda"


def _row(
    op: str,
    variant: str,
    shape: tuple[int, ...],
    nbytes: int,
    fast: Callable[[], object],
    ref: Callable[[], object],
    error: float,
) -> dict[str, object]:
    return timing_row(op, variant, shape, nbytes, time_us(fast), time_us(ref), error)


def _randn(*shape: int, dtype: torch.dtype = BF16, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)


def bench_conv(variant: str, channels: int, batch: int) -> dict[str, object]:
    kernel, slots = 4, 64
    wide = _randn(batch, channels + 2 * 6144)  # x is a column slice of the wider projection output
    x = wide[:, :channels]
    pool = _randn(slots, channels, kernel - 1)
    weight = _randn(channels, kernel, scale=0.5)
    state_in = torch.randperm(slots, device=DEVICE)[:batch]
    state_out = state_in.clone()  # decode writes back where it read
    fresh = torch.zeros(batch, dtype=torch.bool, device=DEVICE)
    y = torch.empty(batch, channels, dtype=BF16, device=DEVICE)

    def ref() -> torch.Tensor:
        window_in = torch.where(~fresh[:, None, None], pool.index_select(0, state_in), 0)
        out, new_window = causal_conv1d_update(x, window_in, weight)
        pool.index_copy_(0, state_out, new_window.to(pool.dtype))
        return out

    def fast() -> torch.Tensor:
        return causal_conv1d_update_slots(x, pool, weight, state_in, state_out, fresh, out=y)

    pool_start = pool.clone()
    want = ref()
    pool_want = pool.clone()
    pool.copy_(pool_start)
    got = fast()
    error = max_rel_error(got, want)
    if not torch.equal(pool, pool_want):
        error = max(error, 1.0)  # a wrong state write shows as a failed check
    state_bytes = batch * channels * (kernel - 1) * 2
    nbytes = 2 * batch * channels * 2 + 2 * state_bytes + channels * kernel * 2
    return _row("conv_update", variant, (batch, channels), nbytes, fast, ref, error)


def bench_rms_norm(variant: str, rows: int, hidden: int) -> list[dict[str, object]]:
    x, mixed = _randn(rows, hidden, scale=2.0), _randn(rows, hidden)
    weight = _randn(hidden, scale=0.5)
    normed, summed = torch.empty_like(x), torch.empty_like(x)
    plain = _row(
        "rms_norm", variant, (rows, hidden), 2 * rows * hidden * 2 + hidden * 2,
        lambda: rms_norm(x, weight, EPS, out=normed),
        lambda: reference.rms_norm(x, weight, EPS),
        max_rel_error(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS)),
    )  # fmt: skip
    got_normed, got_summed = add_rms_norm(x, mixed, weight, EPS)
    want_summed = x + mixed
    error = max_rel_error(got_normed, reference.rms_norm(want_summed, weight, EPS))
    if not torch.equal(got_summed, want_summed):
        error = max(error, 1.0)  # the sum must round exactly like torch's add
    fused = _row(
        "add_rms_norm", variant, (rows, hidden), 4 * rows * hidden * 2 + hidden * 2,
        lambda: add_rms_norm(x, mixed, weight, EPS, out=normed, summed_out=summed),
        lambda: reference.rms_norm(x + mixed, weight, EPS),
        error,
    )  # fmt: skip
    return [plain, fused]


def bench_qk_norm(variant: str, rows: int, heads: int, kv_heads: int) -> list[dict[str, object]]:
    head_dim = 256
    q = _randn(rows, heads, 2 * head_dim, scale=2.0)[..., :head_dim]  # the strided slice of q/gate
    k = _randn(rows, kv_heads, head_dim, scale=2.0)
    out_rows = []
    for name, x in (("q_norm", q), ("k_norm", k)):
        weight = _randn(head_dim, scale=0.5)
        out = torch.empty(x.shape, dtype=BF16, device=DEVICE)
        out_rows.append(
            _row(
                name,
                variant,
                tuple(x.shape),
                2 * x.numel() * 2 + head_dim * 2,
                lambda x=x, weight=weight, out=out: rms_norm(x, weight, EPS, out=out),
                lambda x=x, weight=weight: reference.rms_norm(x, weight, EPS),
                max_rel_error(rms_norm(x, weight, EPS), reference.rms_norm(x, weight, EPS)),
            )  # fmt: skip
        )
    return out_rows


def bench_gated_norm(variant: str, rows: int, value_heads: int) -> dict[str, object]:
    dv = 128
    o = _randn(rows, value_heads, dv, dtype=torch.float32)  # the recurrence output
    z = _randn(rows, value_heads * dv).view(rows, value_heads, dv)
    weight = (_randn(dv).abs() * 0.5 + 0.5).to(BF16)
    out = torch.empty(z.shape, dtype=BF16, device=DEVICE)
    want = reference.gated_rms_norm(o.to(BF16), weight, z, EPS)  # as model.gdn_output does it
    return _row(
        "gated_rms_norm", variant, tuple(o.shape), o.numel() * (4 + 2 + 2) + dv * 2,
        lambda: gated_rms_norm(o, weight, z, EPS, out=out),
        lambda: reference.gated_rms_norm(o.to(BF16), weight, z, EPS),
        max_rel_error(gated_rms_norm(o, weight, z, EPS), want),
    )  # fmt: skip


def bench_decode_attention(
    variant: str, batch: int, heads: int, kv_heads: int, context: int
) -> list[dict[str, object]]:
    """Paged decode attention at each split count (and the default's), pages shuffled, graph replays."""
    page_size, head_dim = 64, 256
    pages = -(-context // page_size)
    k_pages = _randn(batch * pages, page_size, kv_heads, head_dim)
    v_pages = _randn(batch * pages, page_size, kv_heads, head_dim)
    table = torch.randperm(batch * pages, device=DEVICE).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q = _randn(batch, heads, head_dim)
    scale = head_dim**-0.5
    want = reference_decode_attention(q, k_pages, v_pages, table, lens, scale)
    nbytes = 2 * batch * context * kv_heads * head_dim * 2
    default = default_num_splits(batch, kv_heads, pages * page_size, q.device)
    rows = []
    for splits in sorted({1, 4, 8, 16, 32, 64, default}):
        out = torch.empty_like(q)

        def fast(splits: int = splits, out: torch.Tensor = out) -> None:
            paged_decode_attention(q, k_pages, v_pages, table, lens, scale, out=out, num_splits=splits)

        replay = graphed(fast)
        error = max_rel_error(out, want)
        label = f"attn/s{splits}{'*' if splits == default else ''}"
        rows.append(
            _row(label, variant, (batch, heads, context), nbytes, replay,
                 lambda: reference_decode_attention(q, k_pages, v_pages, table, lens, scale), error)
        )  # fmt: skip
    return rows


def main() -> None:
    torch.manual_seed(0)
    rows: list[dict[str, object]] = []
    for variant, (hidden, conv_dim, heads, kv_heads, value_heads) in VARIANTS.items():
        for batch in DECODE_BATCHES:
            for context in (2048, 8192):
                rows.extend(bench_decode_attention(variant, batch, heads, kv_heads, context))
        for batch in DECODE_BATCHES:
            rows.append(bench_conv(variant, conv_dim, batch))
        for n in NORM_ROWS:
            rows.extend(bench_rms_norm(variant, n, hidden))
            rows.extend(bench_qk_norm(variant, n, heads, kv_heads))
            rows.append(bench_gated_norm(variant, n, value_heads))
    finish("small_ops", rows)


if __name__ == "__main__":
    main()
