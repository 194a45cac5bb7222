"""The PDL schedule check (`ninfer.ops.triton.schedule`) and the fast table's recorded decode steps.

Synthetic schedules pin the rule down: a kernel may read before its wait what was written two launches
back, each early launch in a row before it adds one, and a K/V pool written at the step's token positions
may be read early everywhere but each query's newest position only at one token per row. Then the fast
table's forward of the tiny dense and MoE packages is recorded under the Triton interpreter (PDL is off
there, but the flags are recorded as passed) and must pass; forcing the decode attention's early K/V loads
at three tokens per row must fail, naming the prologue.
"""

from __future__ import annotations

import ast
import dataclasses
import threading
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
from pdl_steps import random_store, uniform_step
from triton_interpreter import interpreted_kernels, run_interpreter_child

from ninfer.ops.triton import schedule
from ninfer.ops.triton.schedule import (
    KvPositions,
    Launch,
    PdlScheduleError,
    Region,
    check_schedule,
    checked_schedule,
    recorded_schedule,
)

torch.set_num_threads(1)

X = Region("x", 0x1000, 0x2000)
Y = Region("y", 0x3000, 0x4000)


def _launch(index: int, early: bool = False, reads: tuple[Region, ...] = (), writes: tuple[Region, ...] = ()):
    return Launch(index, f"k{index}", early, reads, writes)


def _schedule(*specs: tuple[bool, tuple[Region, ...], tuple[Region, ...]]) -> list[Launch]:
    """(launches next early, early reads, writes) per launch."""
    return [_launch(i, early, reads, writes) for i, (early, reads, writes) in enumerate(specs)]


def test_reading_early_what_the_previous_kernel_writes_fails() -> None:
    launches = _schedule((False, (), (X,)), (False, (X,), ()))
    message = r"launch 1 `k1` reads `x`.*launch 0 `k0` \(1 launch back\)"
    with pytest.raises(PdlScheduleError, match=message) as e:
        check_schedule(launches)
    assert (e.value.reader.index, e.value.writer.index, e.value.distance) == (1, 0, 1)


def test_two_launches_back_is_complete_unless_the_kernel_between_launches_early() -> None:
    """Legal only because the kernel in between lets its successor start after its own wait."""
    plain = _schedule((False, (), (X,)), (False, (), (Y,)), (False, (X,), ()))
    check_schedule(plain)
    early = _schedule((False, (), (X,)), (True, (), (Y,)), (False, (X,), ()))
    with pytest.raises(PdlScheduleError) as e:
        check_schedule(early)
    assert (e.value.writer.index, e.value.distance) == (0, 2)


@pytest.mark.parametrize("early_between", [0, 1, 2, 3])
def test_each_early_launch_in_a_row_extends_the_window_by_one(early_between: int) -> None:
    """Writer, then one kernel that launches after its wait, then early launches, then the reader four
    launches after the writer: complete while at most two of the three between launch early."""
    between = [(i >= 3 - early_between, (), ()) for i in range(3)]  # the early ones right before the reader
    launches = _schedule((False, (), (X,)), *between, (False, (X,), ()))
    if early_between < 3:
        check_schedule(launches)
        return
    with pytest.raises(PdlScheduleError, match="no launch of the schedule is complete") as e:
        check_schedule(launches)
    assert (e.value.reader.index, e.value.writer.index, e.value.distance) == (4, 0, 4)


def test_a_chain_of_early_launches_fails_at_the_writer_inside_it() -> None:
    """Written three launches back: complete when only the kernel right before the reader launches early,
    racing when the two before it do (the writer is then the last kernel that launched after its wait)."""
    ok = _schedule((False, (), ()), (False, (), (X,)), (False, (), ()), (True, (), ()), (False, (X,), ()))
    check_schedule(ok)
    racing = _schedule((False, (), ()), (False, (), (X,)), (True, (), ()), (True, (), ()), (False, (X,), ()))
    message = r"launch 1 lets its successor start after its wait, 2\.\.3 before theirs"
    with pytest.raises(PdlScheduleError, match=message) as e:
        check_schedule(racing)
    assert (e.value.reader.index, e.value.writer.index, e.value.distance) == (4, 1, 3)
    assert "only launches 0..0 are complete" in str(e.value)


def test_overlap_is_by_memory_range_not_by_tensor() -> None:
    """Views of one buffer: a slice written and an overlapping slice read race; disjoint halves do not."""
    base = torch.zeros(64)
    written, overlapping, other = base[:32], base[16:48], base[32:]
    for read, races in ((overlapping, True), (other, False)):
        with recorded_schedule() as s:
            schedule.record("writer", writes={"out": written})
            schedule.record("reader", early_reads={"in": read})
        if races:
            with pytest.raises(PdlScheduleError):
                s.check()
        else:
            s.check()
    strided = base.view(8, 8)[:, 0]  # a column: its hull spans every row
    with recorded_schedule() as s:
        schedule.record("writer", writes={"out": base[9:10]})
        schedule.record("reader", early_reads={"column": strided})
    with pytest.raises(PdlScheduleError):  # conservative: inside the column's hull, not on the column
        s.check()


def _kv(read: KvPositions | None, write: KvPositions | None) -> list[Launch]:
    pool = (0x10000, 0x20000)
    return _schedule(
        (False, (), (Region("k_pages", *pool, write),)),  # the prologue
        (False, (Region("k_pages", *pool, read),), ()),  # the decode attention
    )


def test_kv_read_but_the_newest_is_apart_from_the_step_tokens_only_at_one_token_per_row() -> None:
    check_schedule(_kv(KvPositions.ALL_BUT_NEWEST, KvPositions.STEP_TOKENS), tokens_per_row=1)
    for tokens in (3, None):  # three tokens per row, or a schedule that does not say
        with pytest.raises(PdlScheduleError, match="each step token's own position"):
            check_schedule(_kv(KvPositions.ALL_BUT_NEWEST, KvPositions.STEP_TOKENS), tokens_per_row=tokens)
    for read, write in ((None, KvPositions.STEP_TOKENS), (KvPositions.ALL_BUT_NEWEST, None)):
        with pytest.raises(PdlScheduleError):  # the whole pool on either side
            check_schedule(_kv(read, write), tokens_per_row=1)


def test_a_recorded_plain_kernel_counts_as_launching_after_its_wait() -> None:
    """norm (not early) -> cuBLAS projection -> a kernel reading the norm's output early: complete."""
    out = torch.zeros(16)
    with checked_schedule() as s:
        schedule.record("norm", writes={"out": out})
        schedule.record_plain("F.linear", writes={"out": torch.zeros(4)})
        schedule.record("gate_up", early_reads={"x": out})
    assert [launch.pdl for launch in s.launches] == [True, False, True]


def test_recording_is_scoped_to_the_block_and_its_thread() -> None:
    assert not schedule.recording
    schedule.record("outside", writes={"out": torch.zeros(1)})  # no schedule open: nothing happens
    seen: list[bool] = []

    def other_thread() -> None:
        seen.append(schedule.recording)
        schedule.record("elsewhere", writes={"out": torch.zeros(1)})

    with recorded_schedule() as s:
        assert schedule.recording
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        schedule.record("inside", launch_next_early=True, writes={"out": torch.zeros(1), "none": None})
    assert not schedule.recording
    assert seen == [True]  # the flag is global, the schedule is the opening thread's
    assert [(launch.kernel, launch.launch_next_early) for launch in s.launches] == [("inside", True)]
    assert [region.name for region in s.launches[0].writes] == ["out"]


def test_checked_schedule_raises_at_the_end_of_the_block() -> None:
    x = torch.zeros(8)
    with pytest.raises(PdlScheduleError, match="`reader` reads `x`"), checked_schedule():
        schedule.record("writer", writes={"x": x})
        schedule.record("reader", early_reads={"x": x})
    assert not schedule.recording


def _launch_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    """The functions that launch a Triton kernel with PDL's launch options (``**pdl.LAUNCH``)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and any(
                    kw.arg is None and ast.unparse(kw.value) == "pdl.LAUNCH" for kw in call.keywords
                ):
                    found.append(node)
                    break
    return found


def test_every_pdl_launch_in_ops_triton_reports_to_the_recorder() -> None:
    """A new PDL launch must record itself, or the schedule check cannot see it."""
    root = Path(__file__).parents[2] / "ninfer" / "ops" / "triton"
    missing, launchers = [], 0
    for path in sorted(root.glob("*.py")):
        for function in _launch_functions(ast.parse(path.read_text())):
            launchers += 1
            source = ast.unparse(function)
            if "schedule.record(" not in source and "_record(" not in source:
                missing.append(f"{path.name}:{function.name}")
    assert launchers >= 15 and not missing, missing


# ---- the fast table's forward, recorded (Triton interpreter child) ----------------------------------------


def test_interpreter_suite_in_a_fresh_process() -> None:
    run_interpreter_child(__file__)


CONTEXT, PAGE_SIZE = 20, 8


@pytest.fixture(scope="module")
def fast() -> ModuleType:
    return interpreted_kernels("ninfer.targets.qwen3_6.kernels")


def _record_forward(fast: ModuleType, package: str, rows: int, tokens: int) -> schedule.Schedule:
    from ninfer.targets.qwen3_6.binder import random_model_view
    from ninfer.targets.qwen3_6.model import forward
    from ninfer.targets.registry import get_package

    variant = dataclasses.replace(get_package(package).variant, vocab_size=512, num_layers=4)
    view = random_model_view(variant, seed=0, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fla-core is not installed: prefill would keep the reference
        kernels = fast.fast_kernels()
    device = torch.device("cpu")
    batch = uniform_step(rows, tokens, CONTEXT, PAGE_SIZE, device)
    store = random_store(variant, rows, tokens, CONTEXT, PAGE_SIZE, torch.float32, device)
    with torch.inference_mode(), checked_schedule(tokens_per_row=tokens) as recorded:
        forward(view, variant, batch, store, logits="last", kernels=kernels)
    return recorded


def _kernels(recorded: schedule.Schedule) -> list[str]:
    return [launch.kernel for launch in recorded.launches]


@pytest.mark.parametrize(("rows", "tokens"), [(1, 1), (3, 1), (1, 3), (3, 3)])
@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_the_fast_forward_passes_the_schedule_check(
    fast: ModuleType, package: str, rows: int, tokens: int
) -> None:
    recorded = _record_forward(fast, package, rows, tokens)  # raises PdlScheduleError on a race
    kernels = _kernels(recorded)
    attention = [launch for launch in recorded.launches if "_paged_decode_kernel" in launch.kernel]
    assert len(attention) == 1  # the one attention layer of four
    early_kv = {region.name for region in attention[0].early_reads} & {"k_pages", "v_pages"}
    assert early_kv == ({"k_pages", "v_pages"} if tokens == 1 else set())
    early = [launch.kernel for launch in recorded.launches if launch.launch_next_early]
    if rows * tokens == 1:  # the small kernels launch their successors early at one token only
        assert "norm._rms_norm_kernel" in early and "gdn_decode._gdn_decode_kernel" in early
    else:
        assert early == []
    assert kernels.count("gdn_decode._gdn_decode_kernel") == 3
    if package == "qwen3_6_tiny_moe":  # the early down launch up to 8 token x expert pairs (top-2 here)
        down = "moe_decode._early_down_combine_kernel"
        if rows * tokens * 2 > 8:
            down = "fused_moe._decode_down_combine_kernel"
        assert kernels.count(down) == 4


def test_early_kv_loads_at_three_tokens_per_row_race_the_prologue(
    fast: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The negative control end to end: the decode attention told to load K/V early in a step of three
    tokens per row reads positions the prologue, one launch before, is writing."""
    import ninfer.ops.attention as attention
    from ninfer.ops.pdl_policy import pdl_policy

    monkeypatch.setattr(
        attention, "pdl_policy", lambda tokens, tokens_per_row=None: dataclasses.replace(
            pdl_policy(tokens, tokens_per_row), settled_kv=True
        ),
    )  # fmt: skip
    with pytest.raises(PdlScheduleError, match="_qk_norm_rope_kv_write_kernel` \\(1 launch back\\)") as e:
        _record_forward(fast, "qwen3_6_tiny", 1, 3)
    assert e.value.read.name == "k_pages" and e.value.read.positions is KvPositions.ALL_BUT_NEWEST


def _record_mtp(fast: ModuleType, package: str, rows: int, tokens: int) -> schedule.Schedule:
    """The MTP block over a uniform step (the draft chain at T = 1, the verify's MTP pass at T > 1),
    recorded: its layer's norms read the stream early only where a norm wrote it, never the fc
    projection's output one launch back."""
    from ninfer.targets.qwen3_6.binder import random_model_view
    from ninfer.targets.qwen3_6.model import StateStore, mtp_forward
    from ninfer.targets.registry import get_package

    variant = dataclasses.replace(get_package(package).variant, vocab_size=512, num_layers=4)
    assert variant.mtp_num_hidden_layers
    view = random_model_view(variant, seed=0, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernels = fast.fast_kernels()
    device = torch.device("cpu")
    batch = uniform_step(rows, tokens, CONTEXT, PAGE_SIZE, device)
    pages = rows * -(-CONTEXT // PAGE_SIZE)
    layers = variant.mtp_num_hidden_layers
    store = StateStore.allocate_kv(variant, layers, pages, PAGE_SIZE, torch.float32, device)
    hidden = torch.randn(rows * tokens, variant.hidden_size)
    with torch.inference_mode(), checked_schedule(tokens_per_row=tokens) as recorded:
        mtp_forward(view, variant, batch.token_ids, hidden, batch, store, kernels)
    return recorded


@pytest.mark.parametrize(("rows", "tokens"), [(1, 1), (3, 1), (2, 4)])
@pytest.mark.parametrize("package", ["qwen3_6_tiny", "qwen3_6_tiny_moe"])
def test_the_fast_mtp_block_passes_the_schedule_check(
    fast: ModuleType, package: str, rows: int, tokens: int
) -> None:
    recorded = _record_mtp(fast, package, rows, tokens)  # raises PdlScheduleError on a race
    assert any("_paged_decode_kernel" in launch.kernel for launch in recorded.launches)
