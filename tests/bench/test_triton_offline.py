"""`tools.triton_offline`: a kernel compiled for sm_90 on a machine without a GPU, read back through ptxas
and nvdisasm (the tools bundled in the Triton wheel)."""

from __future__ import annotations

import pytest
import triton
import triton.language as tl
from ninfer_tools.triton_offline import (
    Report,
    collapse_ops,
    compile_offline,
    presets,
    signature,
    tools_available,
)

pytestmark = pytest.mark.skipif(not tools_available(), reason="ptxas / nvdisasm not found")


@triton.jit
def _scaled_copy(x_ptr, y_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale, mask=mask)


def test_signature_types_by_name() -> None:
    types = signature(_scaled_copy, {"BLOCK": 128}, {"scale": "fp32", "y_ptr": "*fp16"}, "*bf16")
    assert types == {"x_ptr": "*bf16", "y_ptr": "*fp16", "n": "i32", "scale": "fp32", "BLOCK": "constexpr"}


def test_compiles_for_sm90_and_reads_registers_and_sass() -> None:
    report = compile_offline(
        "scaled_copy", _scaled_copy, {"BLOCK": 1024}, types={"scale": "fp32"}, pointer="*fp32", num_warps=4
    )
    assert 0 < report.registers <= 255
    assert report.spill_store_bytes == report.spill_load_bytes == 0
    order = report.op_order().split()
    assert order[0].startswith("LDG") and order[-1].startswith("STG")  # the load, then the store
    assert report.programs_per_sm() == 16  # 4 warps: warp-limited at 64 warps per SM


def test_register_cap_and_residency() -> None:
    capped = compile_offline(
        "capped", _scaled_copy, {"BLOCK": 8192}, types={"scale": "fp32"}, pointer="*fp32", maxnreg=32
    )
    assert capped.registers <= 32
    heavy = Report("r", registers=162, spill_store_bytes=0, spill_load_bytes=0, shared_bytes=0, num_warps=4,
                   sass="")  # fmt: skip
    assert heavy.programs_per_sm() == 3  # 162 x 32 rounds up to 5,376 a warp: 65,536 // 21,504
    assert Report("r", 128, 0, 0, 0, 4, "").programs_per_sm() == 4


def test_collapse_ops_keeps_order_and_counts_runs() -> None:
    sass = "\n".join([
        "/*0010*/ LDG.E.128 R4, desc[UR4][R2.64] ;",
        "/*0020*/ LDG.E.128 R8, desc[UR4][R2.64+0x10] ;",
        "/*0030*/ IMAD R1, R2, R3, RZ ;",
        "/*0040*/ FFMA R4, R4, R8, RZ ;",
        "/*0050*/ STG.E [R6.64], R4 ;",
    ])  # fmt: skip
    assert collapse_ops(sass) == "LDGx2 FFMAx1 STGx1"


def test_presets_compile_against_the_kernels_as_they_are() -> None:
    """Each preset names every constexpr its kernel takes (a kernel that gains or loses one breaks it)."""
    for name, preset in presets().items():
        report = compile_offline(
            name, preset.kernel, preset.constexprs, types=preset.types, num_warps=preset.num_warps,
            maxnreg=preset.maxnreg,
        )  # fmt: skip
        assert 0 < report.registers <= (preset.maxnreg or 255), name
