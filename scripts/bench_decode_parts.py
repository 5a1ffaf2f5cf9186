"""The parts of a batch-1 decode layer, timed inside CUDA graphs: each projection with and without its fused
prologue (RMSNorm or SiLU·mul) against the prologue's own kernel plus cuBLAS, and split-KV decode attention
at several split counts (one split: no merge)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from pocketllm.kernels.attention import decode_splits, paged_decode
from pocketllm.kernels.fused import rms_norm, silu_and_mul
from pocketllm.kernels.gemv import skinny_linear, skinny_rms_norm_linear, skinny_silu_mul_linear, time_in_graph

PROJECTIONS = {  # name: (N, K, prologue); qwen3-0.6b then llama3-8b
    "q06 qkv": (4096, 1024, "norm"), "q06 o": (1024, 2048, None), "q06 gate_up": (6144, 1024, "norm"),
    "q06 down": (1024, 3072, "silu"), "l8 qkv": (6144, 4096, "norm"), "l8 o": (4096, 4096, None),
    "l8 gate_up": (28672, 4096, "norm"), "l8 down": (4096, 14336, "silu"),
}
ATTENTION = {"q06": (16, 8, 128), "l8": (32, 8, 128)}   # heads, KV heads, head dim


def us(fn) -> float:
    return time_in_graph(fn, 50) * 1e3


def projection_row(name: str, n: int, k: int, prologue: str | None) -> str:
    weights = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(2 if n * k > 3e7 else 8)]
    turn = [0]

    def weight() -> torch.Tensor:  # rotate through copies so small weights are not served from L2
        turn[0] += 1
        return weights[turn[0] % len(weights)]

    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    cublas, skinny = us(lambda: F.linear(x, weight())), us(lambda: skinny_linear(x, weight()))
    best = skinny_linear if skinny < cublas else F.linear
    line = f"{name:12s} {cublas:8.1f} {skinny:8.1f}"
    if prologue == "norm":
        r, nw = torch.randn_like(x), torch.rand(k, dtype=torch.bfloat16, device="cuda")
        two = us(lambda: best(rms_norm(x, nw, 1e-6, r)[0], weight()))
        fused = us(lambda: skinny_rms_norm_linear(x, r, nw, 1e-6, weight()))
        line += f" {two:14.1f} {fused:8.1f}"
    elif prologue == "silu":
        gu = torch.randn(1, 2 * k, dtype=torch.bfloat16, device="cuda")
        two = us(lambda: best(silu_and_mul(gu), weight()))
        fused = us(lambda: skinny_silu_mul_linear(gu, weight()))
        line += f" {two:14.1f} {fused:8.1f}"
    return line


def attention_row(name: str, heads: int, kv_heads: int, dim: int, batch: int, ctx: int) -> str:
    blocks = batch * (ctx // 16 + 1)
    k_cache = torch.randn(blocks, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(blocks, dtype=torch.int32, device="cuda").view(batch, -1)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")

    def run(splits: int) -> torch.Tensor:
        return paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, splits, counters=counters)

    times = [us(lambda s=s: run(s)) for s in (1, 4, 16)]
    auto = decode_splits(batch, kv_heads)
    return f"{name:10s} {batch:5d} {ctx:5d} " + " ".join(f"{t:8.1f}" for t in times) + f" {auto:7d}"


def attention_variants(heads: int, kv_heads: int, dim: int, ctx: int) -> None:
    """Batch-1 decode attention over tile sizes, warps and pipeline stages (µs; splits as the engine picks)."""
    k_cache = torch.randn(ctx // 16 + 1, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(ctx // 16 + 1, dtype=torch.int32, device="cuda").view(1, -1)
    lens = torch.full((1,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(1, heads, dim, dtype=torch.bfloat16, device="cuda")
    counters = torch.zeros(kv_heads, dtype=torch.int32, device="cuda")
    results = []
    for splits in (4, 16):
        for block_n in (16, 32, 64):
            for warps in (1, 2, 4):
                for stages in (1, 2, 3):
                    def run(s=splits, b=block_n, w=warps, st=stages) -> torch.Tensor:
                        return paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, s, counters=counters,
                                            block_n=b, num_warps=w, num_stages=st)
                    results.append((us(run), splits, block_n, warps, stages))
    results.sort()
    print(f"batch-1 attention, ctx {ctx}, heads {heads}/{kv_heads}: best (µs, splits, block_n, warps, stages):")
    for row in results[:5]:
        print("   ", row)


def large_batch_variants(heads: int, kv_heads: int, dim: int, batch: int, ctx: int) -> None:
    """Decode attention at a large batch (one split) over KV tile, warps, stages and the grid's order; the
    context's pages are spread over the cache as a long-running server leaves them."""
    pages = ctx // 16 + 1
    k_cache = torch.randn(batch * pages, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    nbytes = 2 * batch * ctx * kv_heads * dim * 2
    results = []
    for block_n in (32, 64, 128):
        for warps in (4, 8):
            for stages in (2, 3, 4):
                for heads_first in (False, True):
                    def run(b=block_n, w=warps, st=stages, h=heads_first) -> torch.Tensor:
                        return paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 1, block_n=b,
                                            num_warps=w, num_stages=st, heads_first=h)
                    try:
                        results.append((us(run), block_n, warps, stages, heads_first))
                    except Exception as exc:  # e.g. out of shared memory
                        print(f"  block_n {block_n} warps {warps} stages {stages}: {type(exc).__name__}")
    results.sort()
    default = us(lambda: paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 1))
    print(f"attention batch {batch} ctx {ctx}, heads {heads}/{kv_heads}: default {default:.1f} µs "
          f"({nbytes / default / 1e3:,.0f} GB/s); best (µs, GB/s, block_n, warps, stages, heads first):")
    for t, *rest in results[:6]:
        print(f"    {t:7.1f} {nbytes / t / 1e3:7,.0f}", *rest)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "large-batch":
        large_batch_variants(16, 8, 128, 256, 800)
        large_batch_variants(32, 8, 128, 64, 1024)
        return
    print(f"{'projection':12s} {'cuBLAS':>8s} {'skinny':>8s} {'prologue+best':>14s} {'fused':>8s}  µs, M=1")
    for name, (n, k, prologue) in PROJECTIONS.items():
        print(projection_row(name, n, k, prologue))
    print(f"{'attention':10s} {'batch':>5s} {'ctx':>5s} " + " ".join(f"{f'S={s}':>8s}" for s in (1, 4, 16))
          + f" {'auto S':>7s}  µs")
    for name, (heads, kv_heads, dim) in ATTENTION.items():
        for batch, ctx in ((1, 256), (1, 2048), (64, 1024)):
            print(attention_row(name, heads, kv_heads, dim, batch, ctx))
    for ctx in (256, 2048):
        attention_variants(32, 8, 128, ctx)


if __name__ == "__main__":
    main()
