"""Instructions per weight in the one-row product's K loop, compiled for sm_90 on a machine without a GPU: Triton
compiles the kernel for the target, its bundled cuobjdump disassembles the cubin, and the loop (the body of the
last backward branch) is counted against the weights one pass of it multiplies.

    python scripts/one_row_instructions.py                          # the engine's float8 and bfloat16 candidates
    python scripts/one_row_instructions.py --weight fp8 --config 32,256,0,4 --prologue rms_norm

A one-row product issues this many instructions for every weight it streams: where that times the weights a
second of the GPU's bandwidth brings comes near the multiprocessors' issue rate, the product is bound by issue, not
memory. The count includes what only program 0 runs in the loop (the RMSNorm prologue's residual store, a few
instructions a tile), so it is a little high for the others.
Compile with the Triton release of the GPU machine (install it into a folder of its own, first on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

import triton
from sm90_compile import compile_sm90, triton_tool

from pocketllm.kernels.gemv import OneRowConfig, _one_row_kernel, one_row_candidates

WEIGHT_TYPES = {"fp8": "*fp8e4nv", "bf16": "*bf16"}
PROLOGUES = {"none": 0, "silu_mul": 1, "rms_norm": 2}
INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
BACKWARD = re.compile(r"/\*([0-9a-f]{4,})\*/.*\bBRA\s+0x([0-9a-f]+)")


def compile_one_row(weight: str, config: OneRowConfig, prologue: int, silu_epilogue: bool) -> bytes:
    """The cubin of one variant (float8 weights come with per-row scales; PDL on, as the engine launches it)."""
    types = {"x_ptr": "*bf16", "w_ptr": WEIGHT_TYPES[weight], "scale_ptr": "*fp32", "out_ptr": "*bf16",
             "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "normed_ptr": "*bf16", "N": "i32",
             "K": "i32", "stride_wn": "i32", "eps": "fp32"}
    constants = dict(BLOCK_N=config.block_n, BLOCK_K=config.block_k, REDUCE_EACH=config.reduce_each,
                     PROLOGUE=prologue, HAS_RESIDUAL=prologue == 2, NORM_OFFSET=False, SILU_EPILOGUE=silu_epilogue,
                     HAS_SCALE=weight == "fp8", NORMED_OUT=False, PDL=True)
    # As the launcher specialises them: pointers, K and the row stride divisible by 16.
    aligned = [n for n in types if types[n][0] == "*" or n in ("K", "stride_wn")]
    compiled = compile_sm90(_one_row_kernel, types, constants, aligned, config.num_warps, config.num_stages)
    return compiled.asm["cubin"]


def loop_counts(cubin: bytes) -> tuple[collections.Counter[str], dict[str, int]]:
    """(instruction counts of the K loop's body, the kernel's registers and stack bytes)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        # one pass of the tool: the SASS listing, then each function's resource line
        sass = subprocess.run([triton_tool("cuobjdump"), "-sass", "-res-usage", path], capture_output=True,
                              text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in map(INSTRUCTION.search, sass.splitlines()) if m]
    body: list[str] = []
    for m in map(BACKWARD.search, sass.splitlines()):
        if m and int(m.group(2), 16) < int(m.group(1), 16):   # (the trailing self-branch is not a loop)
            first, last = int(m.group(2), 16), int(m.group(1), 16)
            body = [op for address, op in lines if first <= address <= last]
    if not body:
        raise RuntimeError("no loop found in the kernel's SASS (K no longer than one tile?)")
    resources = {key.lower(): int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", sass)}
    return collections.Counter(body), resources


def _config(text: str) -> OneRowConfig:
    """``BLOCK_N,BLOCK_K,REDUCE_EACH,WARPS`` (REDUCE_EACH 0 or 1) → a one-stage setting."""
    try:
        block_n, block_k, reduce_each, warps = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected BLOCK_N,BLOCK_K,REDUCE_EACH,WARPS (four integers), got {text!r}") from None
    return OneRowConfig(block_n, block_k, bool(reduce_each), warps, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weight", choices=sorted(WEIGHT_TYPES), action="append")
    parser.add_argument("--config", action="append", type=_config, help="BLOCK_N,BLOCK_K,REDUCE_EACH(0/1),WARPS")
    parser.add_argument("--prologue", choices=sorted(PROLOGUES), action="append")
    parser.add_argument("--silu-epilogue", action="store_true", help="the [gate; up] weight with SiLU·mul after")
    parser.add_argument("--k", type=int, default=4096, help="the row length the candidates are made for")
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm_90: instructions of the K loop per weight it multiplies")
    for weight in args.weight or ["fp8", "bf16"]:
        configs = args.config or one_row_candidates(args.k, float8=weight == "fp8")
        for prologue in args.prologue or ["none", "rms_norm"]:
            for config in configs:
                ops, resources = loop_counts(compile_one_row(weight, config, PROLOGUES[prologue], args.silu_epilogue))
                weights = (2 if args.silu_epilogue else 1) * config.block_n * config.block_k / (32 * config.num_warps)
                total = sum(ops.values())
                top = ", ".join(f"{op} {n}" for op, n in ops.most_common(4))
                label = (f"{weight} {prologue:8s} rows {config.block_n:2d} cols {config.block_k:4d} "
                         f"{'sum each' if config.reduce_each else 'sum once'} warps {config.num_warps:2d}")
                print(f"{label:58s} {total / weights:5.2f} a weight  registers {resources.get('reg')} "
                      f"stack {resources.get('stack')}  ({top})")


if __name__ == "__main__":
    main()
