"""Triton step unpack (`ninfer.ops.triton.step_unpack`) against `StepBuilder.unpack`'s torch expressions:
decode and prefill layouts, table widths over several column blocks and not a power of two, and a
decode's token ids fed from the device where the packed ones are negative."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from triton_interpreter import interpreted_kernels, run_interpreter_child

torch.set_num_threads(1)


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return interpreted_kernels("ninfer.ops.triton.step_unpack")


def _packed(
    num_tokens: int, num_rows: int, num_sequences: int, seed: int, device: str = "cpu"
) -> torch.Tensor:
    """A random vector in the `StepFields` layout: values past int32 in the cast fields, fresh flags other
    than 0/1 (anything nonzero is True), sequence indices with repeats and in no order."""
    g = torch.Generator().manual_seed(seed)
    n, b = num_tokens, num_rows

    def rand(size: int, low: int, high: int) -> torch.Tensor:
        return torch.randint(low, high, (size,), generator=g, dtype=torch.int64)

    fields = [
        rand(3 * n, 0, 1 << 40),  # token ids, positions, KV slots: not read
        rand(b + 1, -(1 << 33), 1 << 33),  # query_start
        rand(b, -(1 << 33), 1 << 33),  # context_lens
        rand(2 * b, 0, 1 << 20),  # state_in, state_out: not read
        rand(b, -2, 3),  # fresh
        rand(b, 0, num_sequences),  # sequence_index
    ]
    return torch.cat(fields).to(device)


def _torch_unpack(
    values: torch.Tensor, n: int, b: int, tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`StepBuilder.unpack`'s torch expressions over the `PackedStep.fields` split."""
    fields = values.split([n, n, n, b + 1, b, b, b, b, b])
    query_start, context_lens, fresh, sequence_index = fields[3], fields[4], fields[7], fields[8]
    return query_start.int(), context_lens.int(), tables.index_select(0, sequence_index), fresh.bool()


def _check(got: tuple[torch.Tensor | None, ...], want: tuple[torch.Tensor, ...]) -> None:
    """The four unpacked tensors equal; no token ids without a feed."""
    assert got[4] is None
    names = ("query_start", "context_lens", "block_table", "fresh")
    for name, g, w in zip(names, got[:4], want, strict=True):
        assert g is not None
        assert g.dtype == w.dtype and g.shape == w.shape, (name, g.dtype, g.shape, w.dtype, w.shape)
        assert g.is_contiguous(), name
        assert torch.equal(g, w), name
    assert set(got[3].view(torch.uint8).tolist()) <= {0, 1}  # a real bool: 0 or 1 in memory


@pytest.mark.parametrize("num_tokens, num_rows", [(1, 1), (3, 3), (8, 8), (9, 1), (40, 3), (100, 8)])
@pytest.mark.parametrize("max_pages", [1, 37, 1024, 2600])
def test_matches_torch(kernels: ModuleType, num_tokens: int, num_rows: int, max_pages: int) -> None:
    """Decode (N == B) and prefill (N > B) layouts; 2600 pages is three column blocks, the last partial."""
    g = torch.Generator().manual_seed(max_pages)
    tables = torch.randint(-(1 << 31), (1 << 31) - 1, (5, max_pages), generator=g, dtype=torch.int32)
    values = _packed(num_tokens, num_rows, 5, seed=num_tokens * 100 + num_rows)
    got = kernels.unpack_step(values, num_tokens, num_rows, tables)
    _check(got, _torch_unpack(values, num_tokens, num_rows, tables))


def test_strided_table_rows_and_no_rows(kernels: ModuleType) -> None:
    """A table that is a column slice of a wider one (row stride 50), and a step of no rows."""
    wide = torch.arange(4 * 50, dtype=torch.int32).view(4, 50)
    tables = wide[:, 3:40]
    values = _packed(6, 3, 4, seed=7)
    _check(kernels.unpack_step(values, 6, 3, tables), _torch_unpack(values, 6, 3, tables))
    empty = torch.tensor([0, 0, 0, 42], dtype=torch.int64)  # one token's three fields, query_start [42]
    query_start, context_lens, table, fresh, _ = kernels.unpack_step(empty, 1, 0, tables)
    assert query_start.tolist() == [42] and query_start.dtype == torch.int32
    assert context_lens.shape == (0,) and table.shape == (0, 37) and fresh.shape == (0,)
    assert fresh.dtype == torch.bool


def _decode_with_fed_rows(num_rows: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(a decode's packed values with the token ids of every other row -1, the feed)."""
    values = _packed(num_rows, num_rows, 5, seed=seed, device=device)
    values[0:num_rows:2] = -1
    feed = torch.arange(100, 100 + num_rows, dtype=torch.int64, device=device)
    return values, feed


@pytest.mark.parametrize("num_rows", [1, 3, 8])
def test_feed_fills_the_negative_token_ids(kernels: ModuleType, num_rows: int) -> None:
    tables = torch.randint(0, 1 << 20, (5, 37), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    values, feed = _decode_with_fed_rows(num_rows, seed=num_rows)

    *got, token_ids = kernels.unpack_step(values, num_rows, num_rows, tables, feed)

    packed = values[:num_rows]
    assert token_ids is not None and token_ids.dtype == torch.int64
    assert torch.equal(token_ids, torch.where(packed < 0, feed, packed))
    assert token_ids[0] == 100 and (num_rows == 1 or token_ids[1] == packed[1])
    _check((*got, None), _torch_unpack(values, num_rows, num_rows, tables))


def test_bad_input(kernels: ModuleType) -> None:
    tables = torch.zeros(4, 37, dtype=torch.int32)
    values = _packed(3, 3, 4, seed=1)
    with pytest.raises(ValueError, match="must be >= 0"):
        kernels.unpack_step(values, 3, -1, tables)
    with pytest.raises(ValueError, match="length 3 \\* num_tokens"):  # 28 values, 3 tokens and 4 rows want 34
        kernels.unpack_step(values, 3, 4, tables)
    with pytest.raises(ValueError, match="1-D int64"):
        kernels.unpack_step(values.int(), 3, 3, tables)
    with pytest.raises(ValueError, match="1-D int64"):
        kernels.unpack_step(values.view(4, 7), 3, 3, tables)
    with pytest.raises(ValueError, match="unit stride"):
        kernels.unpack_step(torch.zeros(56, dtype=torch.int64)[::2], 3, 3, tables)
    with pytest.raises(ValueError, match="2-D int32"):
        kernels.unpack_step(values, 3, 3, tables.long())
    with pytest.raises(ValueError, match="2-D int32"):
        kernels.unpack_step(values, 3, 3, tables[0])
    with pytest.raises(ValueError, match="unit last stride"):
        kernels.unpack_step(values, 3, 3, torch.zeros(37, 4, dtype=torch.int32).t())
    with pytest.raises(ValueError, match="block_tables is on meta"):
        kernels.unpack_step(values, 3, 3, tables.to("meta"))
    feed = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="feed needs a decode"):
        kernels.unpack_step(_packed(4, 3, 4, seed=1), 4, 3, tables, feed)
    with pytest.raises(ValueError, match="feed needs a decode"):
        kernels.unpack_step(values, 3, 3, tables, feed.int())
    with pytest.raises(ValueError, match="feed needs a decode"):
        kernels.unpack_step(values, 3, 3, tables, feed[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens, num_rows", [(1, 1), (8, 8), (300, 8)])
def test_matches_torch_on_cuda(num_tokens: int, num_rows: int) -> None:
    """The compiled kernel over a 4096-page table (four column blocks)."""
    from ninfer.ops.triton.step_unpack import unpack_step

    tables = torch.randint(0, 1 << 30, (16, 4096), dtype=torch.int32, device="cuda")
    values = _packed(num_tokens, num_rows, 16, seed=num_rows, device="cuda")
    got = unpack_step(values, num_tokens, num_rows, tables)
    _check(got, _torch_unpack(values, num_tokens, num_rows, tables))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 8])
def test_feed_on_cuda(num_rows: int) -> None:
    from ninfer.ops.triton.step_unpack import unpack_step

    tables = torch.randint(0, 1 << 30, (16, 4096), dtype=torch.int32, device="cuda")
    values, feed = _decode_with_fed_rows(num_rows, seed=num_rows, device="cuda")
    *got, token_ids = unpack_step(values, num_rows, num_rows, tables, feed)
    packed = values[:num_rows]
    assert token_ids is not None and torch.equal(token_ids, torch.where(packed < 0, feed, packed))
    _check((*got, None), _torch_unpack(values, num_rows, num_rows, tables))
