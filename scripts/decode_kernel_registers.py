"""Registers, spills and shared-memory instructions of the decode attention kernel compiled for sm_90, on a machine
without a GPU: Triton compiles to PTX for the target and its bundled ptxas assembles it (``-v``).

    python scripts/decode_kernel_registers.py                  # a float8 and a bfloat16 cache, a few launch settings
    python scripts/decode_kernel_registers.py --cache fp8 --block-n 128 --warps 4 --stages 3

Compile with the Triton release of the GPU machine (its ptxas decides the registers): install it into a folder of
its own and put that first on PYTHONPATH. The shapes are Qwen3-0.6B's (16 query heads, 8 KV heads, 128 wide).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from sm90_compile import compile_sm90, triton_tool

from pocketllm.kernels.attention import _decode_kernel

CACHE_TYPES = {"fp8": "*fp8e4nv", "bf16": "*bf16"}
COUNTED = ("ld.shared", "st.shared", "ldmatrix", "mma.sync", "cp.async", "bar.sync")


def compile_decode(cache: str, block_n: int, warps: int, stages: int, fp8_pairs: bool) -> dict[str, object]:
    """ptxas's report and instruction counts of one decode kernel variant (one split, the grid's KV heads first)."""
    fp8 = cache == "fp8"
    types = {"q_ptr": "*bf16", "k_cache_ptr": CACHE_TYPES[cache], "v_cache_ptr": CACHE_TYPES[cache],
             "tables_ptr": "*i32", "lens_ptr": "*i32", "out_ptr": "*bf16", "part_ptr": "*fp32", "lse_ptr": "*fp32",
             "count_ptr": "*i32", "stride_qt": "i32", "stride_ot": "i32", "stride_table": "i32", "scale": "fp32",
             "num_splits": "i32", "window": "i32"}
    constants = dict(NUM_KV_HEADS=8, GROUP=2, GROUP_PAD=16, HEAD_DIM=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=block_n,
                     SPLIT_MIN=block_n, SPLIT=False, S_PAD=1, PRECISION="tf32", HEADS_FIRST=True, FP16_DOTS=fp8,
                     FP8_PAIRS=fp8 and fp8_pairs, PDL=False)
    # As the launcher specialises them: pointers and row strides divisible by 16.
    aligned = [n for n in types if types[n][0] == "*" or "stride" in n]
    compiled = compile_sm90(_decode_kernel, types, constants, aligned, warps, stages)
    ptx = compiled.asm["ptx"]
    report = ""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        for ptxas in ("ptxas", "ptxas-blackwell"):   # (the first may predate the PTX version this Triton writes)
            run = subprocess.run([triton_tool(ptxas), "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                                 capture_output=True, text=True)
            report = run.stderr
            if run.returncode == 0:
                break
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    return {"registers": int(registers.group(1)) if registers else None,
            "spill stores/loads": f"{spills.group(1)}/{spills.group(2)}" if spills else report.strip()[-200:],
            "shared bytes": compiled.metadata.shared, **{op: ptx.count(op) for op in COUNTED}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", choices=sorted(CACHE_TYPES), action="append")
    parser.add_argument("--block-n", type=int, action="append")
    parser.add_argument("--warps", type=int, action="append")
    parser.add_argument("--stages", type=int, default=3)
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90, Qwen3-0.6B heads, one split")
    for cache in args.cache or ["fp8", "bf16"]:
        for pairs in (False, True) if cache == "fp8" else (False,):
            for block_n in args.block_n or [64, 128]:
                for warps in args.warps or [4, 8]:
                    result = compile_decode(cache, block_n, warps, args.stages, pairs)
                    label = f"{cache}{' pairs' if pairs else ''} block_n {block_n} warps {warps} stages {args.stages}"
                    print(f"{label:40s}", "  ".join(f"{k} {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
