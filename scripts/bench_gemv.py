"""Skinny matrix products: cuBLAS (F.linear) against the Triton skinny kernel on decode shapes, and the
device's copy bandwidth (the bound), timed with CUDA events."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pocketllm.kernels.gemv import skinny_linear, time_in_graph

SHAPES = {  # (N, K): qwen3-0.6b then llama3-8b: qkv, o, gate_up, down, lm_head
    "q06 qkv": (4096, 1024), "q06 o": (1024, 2048), "q06 gate_up": (6144, 1024), "q06 down": (1024, 3072),
    "q06 lm_head": (151936, 1024), "l8 qkv": (6144, 4096), "l8 o": (4096, 4096), "l8 gate_up": (28672, 4096),
    "l8 down": (4096, 14336), "l8 lm_head": (128256, 4096),
}


def timed(fn, repeats: int = 50) -> float:
    """µs per call, replayed from a CUDA graph (as in a decode step: no host launch cost)."""
    return time_in_graph(fn, repeats) * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, device="cuda")  # 4 GiB
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), 5)
    return 2 * src.numel() * 4 / us / 1e3  # GB/s


def row(name: str, n: int, k: int, m: int) -> str:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(2 if n * k > 3e7 else 8)]
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    nbytes = n * k * 2
    turn = [0]

    def weight() -> torch.Tensor:  # rotate through copies so small weights are not served from L2
        turn[0] += 1
        return weights[turn[0] % len(weights)]

    t_ref = timed(lambda: F.linear(x, weight()))
    cols = []
    for bn, bk, st in VARIANTS:
        t = timed(lambda bn=bn, bk=bk, st=st: skinny_linear(x, weight(), bn, bk, st))
        cols.append(f"{t:9.1f} {nbytes / t / 1e3:6,.0f}")
    return f"{name:14s} {m:3d} {t_ref:10.1f} {nbytes / t_ref / 1e3:7,.0f} | " + " | ".join(cols)


VARIANTS = ((None, None, 4), (64, 128, 4), (128, 64, 4))  # None: the one-row auto choice


def main() -> None:
    print(f"copy bandwidth: {copy_bandwidth():,.0f} GB/s (4 GiB, read + write)")
    print(f"{'shape':14s} {'M':>3s} {'cuBLAS µs':>10s} {'GB/s':>7s} | " + " | ".join(
        f"skinny n{bn} k{bk} s{st} µs  GB/s" for bn, bk, st in VARIANTS))
    for name, (n, k) in SHAPES.items():
        for m in (1, 8):
            print(row(name, n, k, m))

if __name__ == "__main__":
    main()
