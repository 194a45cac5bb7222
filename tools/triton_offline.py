"""Compile a Triton kernel for an NVIDIA GPU on a machine without one: registers, spills, shared memory
and the order of its instructions.

    python3 -m tools.triton_offline [--arch 90] [--only NAME] [--sass]

Triton lowers a kernel to PTX on any machine and its wheel bundles `ptxas` and `nvdisasm`, so what decides
a launch's residency (registers and shared memory per program: how many programs fit on an SM, how many
waves a grid takes) and whether a kernel's loads are issued together or one after another can be read
before a device is lent. The presets are the one-row decode kernels of Qwen3.6-35B-A3B. Triton here (the
CPU CI's) and on the device may be different versions: a guide for choosing what to time, not a
measurement (docs/benchmarks.md, run 17's session).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import tempfile
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

REGISTER_FILE = 65536  # 32-bit registers per SM (sm_80 .. sm_90)
MAX_WARPS_PER_SM = 64
# SASS opcodes worth seeing in order: global loads and stores, barriers, shuffles, FMAs
_TRACKED = ("LDG", "STG", "BAR", "SHFL", "FFMA", "HFMA2", "HMMA", "LDS", "STS")


@dataclasses.dataclass(frozen=True)
class Report:
    name: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    shared_bytes: int
    num_warps: int
    sass: str

    def programs_per_sm(self) -> int:
        """Resident programs per SM as registers and warps allow (shared memory aside); registers are
        allocated per warp in units of 256."""
        per_warp = -(-self.registers * 32 // 256) * 256
        return min(REGISTER_FILE // (per_warp * self.num_warps), MAX_WARPS_PER_SM // self.num_warps)

    def op_order(self) -> str:
        """The tracked SASS opcodes in program order, runs collapsed: `LDGx24 FFMAx2 ...`."""
        return collapse_ops(self.sass)


def _tool(name: str) -> str:
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    if os.path.exists(bundled):
        return bundled
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is neither in the Triton wheel ({bundled}) nor on PATH")
    return found


def tools_available() -> bool:
    try:
        _tool("ptxas"), _tool("nvdisasm")
    except FileNotFoundError:
        return False
    return True


def signature(kernel: Any, constexprs: dict[str, Any], types: dict[str, str], pointer: str) -> dict[str, str]:
    """Every argument's Triton type: constexprs by name, `types` where given, `*_ptr` arguments `pointer`,
    the rest i32."""
    def kind(name: str) -> str:
        if name in constexprs:
            return "constexpr"
        return types.get(name, pointer if name.endswith("_ptr") else "i32")

    return {name: kind(name) for name in kernel.arg_names}


def collapse_ops(sass: str) -> str:
    ops = []
    for line in sass.splitlines():
        match = re.search(r"\b(" + "|".join(_TRACKED) + r")\b", line)
        if match is None:
            continue
        if ops and ops[-1][0] == match.group(1):
            ops[-1][1] += 1
        else:
            ops.append([match.group(1), 1])
    return " ".join(f"{op}x{count}" for op, count in ops)


def compile_offline(
    name: str,
    kernel: Any,
    constexprs: dict[str, Any],
    *,
    types: dict[str, str] | None = None,
    pointer: str = "*bf16",
    num_warps: int = 4,
    num_stages: int = 2,
    maxnreg: int | None = None,
    arch: int = 90,
) -> Report:
    """Compile `kernel` (a `@triton.jit` function) for sm_`arch` and read ptxas's and nvdisasm's reports."""
    source = ASTSource(kernel, signature(kernel, constexprs, types or {}, pointer), constexprs)
    options: dict[str, Any] = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    gpu_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        info = subprocess.run(
            [_tool("ptxas"), "-v", "--gpu-name", gpu_name, ptx, "-o", os.devnull],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
        sass = subprocess.run(
            [_tool("nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True
        ).stdout

    def number(pattern: str) -> int:
        match = re.search(pattern, info)
        return int(match.group(1)) if match else 0

    return Report(
        name=name,
        registers=number(r"Used (\d+) registers"),
        spill_store_bytes=number(r"(\d+) bytes spill stores"),
        spill_load_bytes=number(r"(\d+) bytes spill loads"),
        shared_bytes=int(compiled.metadata.shared),
        num_warps=num_warps,
        sass=sass,
    )


@dataclasses.dataclass(frozen=True)
class Preset:
    kernel: Any  # a @triton.jit function
    constexprs: dict[str, Any]
    types: dict[str, str]
    num_warps: int = 4
    maxnreg: int | None = None


def presets() -> dict[str, Preset]:
    """Qwen3.6-35B-A3B one-row decode kernels with the fast table's tiles (16 query and 2 KV heads of 256,
    128 splits; 256 experts, top-8, width 512, hidden 2048; 32 value heads of 128x128 GDN state)."""
    from ninfer.ops.triton import gdn_decode, moe_decode, paged_decode_attention

    gate_up = moe_decode.default_gate_up_config(8)
    fp32, pdl = "*fp32", {"LAUNCH_NEXT_EARLY": True, "USE_PDL": True}
    return {
        "paged_decode": Preset(
            paged_decode_attention._paged_decode_kernel,
            dict(NUM_HEADS=16, GROUP=8, HEAD_DIM=256, PAGE_SIZE=64, NUM_SPLITS=128, BLOCK_G=16, BLOCK_D=256,
                 BLOCK_N=32, DOT_PRECISION="tf32", GATED=True, SETTLED=True, PRELOAD_BLOCKS=1,
                 STALE_NEWEST=False, **pdl),
            {"scale": "fp32", "block_table_ptr": "*i32", "context_lens_ptr": "*i32", "partial_out_ptr": fp32,
             "partial_lse_ptr": fp32},
        ),
        "merge_splits": Preset(
            paged_decode_attention._merge_splits_kernel,
            dict(NUM_HEADS=16, HEAD_DIM=256, NUM_SPLITS=128, BLOCK_S=128, BLOCK_D=64, GATED=True, **pdl),
            {"partial_out_ptr": fp32, "partial_lse_ptr": fp32},
        ),
        "routed_gate_up": Preset(
            moe_decode._routed_gate_up_kernel,
            dict(NUM_EXPERTS=256, TOP_K=8, BLOCK_E=256, BLOCK_SLOTS=8, BLOCK_N=gate_up.block_n,
                 N_LOOP=gate_up.n_loop, BLOCK_K=2048, K_STEPS=1, HIDDEN_SIZE=2048, EVEN_K=True, BLOCK_H=2048,
                 NARROW_KEYS=gate_up.narrow_keys, USE_PDL=True),
            {"weights_ptr": fp32, "ids_ptr": "*i32", "shared_weight_ptr": fp32},
            num_warps=gate_up.warps,
        ),
        "early_down": Preset(
            moe_decode._early_down_combine_kernel,
            dict(NUM_EXPERTS=256, TOP_K=8, BLOCK_E=256, BLOCK_H=4, BLOCK_I=512, I_STEPS=1, EXPERTS_PER_STEP=8,
                 INTER_SIZE=512, EVEN_I=True, PRELOAD_GROUPS=1, PRELOAD_STEPS=1, **pdl),
            {"weights_ptr": fp32, "shared_weight_ptr": fp32},
            maxnreg=moe_decode.EARLY_DOWN_MAXNREG,
        ),
        "gdn_decode": Preset(
            gdn_decode._gdn_decode_kernel,
            dict(NV=32, GROUP=2, DK=128, DV=128, BLOCK_K=128, BLOCK_V=32, WRITE_SCRATCH=False,
                 PER_POSITION=False, HAS_FRESH=True, SETTLED=True, **pdl),
            {"state_in_ptr": "*i64", "state_out_ptr": "*i64", "fresh_ptr": "*i1", "pool_ptr": fp32,
             "scratch_ptr": fp32, "o_ptr": fp32, "a_log_ptr": fp32, "dt_bias_ptr": fp32, "scale": "fp32",
             "eps": "fp32"},
        ),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    parser.add_argument("--only", help="one preset (default: all of them)")
    parser.add_argument("--sass", action="store_true", help="also print each kernel's SASS opcode order")
    args = parser.parse_args()
    table = presets()
    names = [args.only] if args.only else list(table)
    print(f"{'kernel':<16} {'regs':>5} {'spill st/ld B':>14} {'smem B':>8} {'warps':>5} {'programs/SM':>12}")
    for name in names:
        preset = table[name]
        report = compile_offline(
            name, preset.kernel, preset.constexprs, types=preset.types, num_warps=preset.num_warps,
            maxnreg=preset.maxnreg, arch=args.arch,
        )  # fmt: skip
        spills = f"{report.spill_store_bytes}/{report.spill_load_bytes}"
        print(
            f"{name:<16} {report.registers:>5} {spills:>14} {report.shared_bytes:>8} {report.num_warps:>5} "
            f"{report.programs_per_sm():>12}"
        )
        if args.sass:
            print("  " + report.op_order())


if __name__ == "__main__":
    main()
