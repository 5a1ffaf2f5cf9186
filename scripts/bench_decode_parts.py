"""The parts of a batch-1 decode layer, timed inside CUDA graphs: each projection with and without its fused
prologue (RMSNorm or SiLU·mul) against the prologue's own kernel plus cuBLAS, and split-KV decode attention
at several split counts (one split: no merge).

    python scripts/bench_decode_parts.py               # projections and attention at batch 1
    python scripts/bench_decode_parts.py large-batch   # attention settings at batch 256 and 64
    python scripts/bench_decode_parts.py fp8-cache     # the same at batch 256 for a bfloat16 and a float8 cache
    python scripts/bench_decode_parts.py packed        # QKV projection then attention: two kernels or one
    python scripts/bench_decode_parts.py prefill       # prefill attention settings on a throughput chunk
    python scripts/bench_decode_parts.py small-batch   # batch-1 attention settings inside a layer's chain
    python scripts/bench_decode_parts.py fp8-weights   # one-row product settings on Llama-3-8B's float8 weights
"""

from __future__ import annotations

import sys
from functools import partial

import torch
import torch.nn.functional as F

from pocketllm.kernels import attention
from pocketllm.kernels.attention import decode_splits, paged_decode, paged_decode_packed, paged_prefill
from pocketllm.kernels.fp8 import quantize_weight
from pocketllm.kernels.fused import qkv_prepare, rms_norm, silu_and_mul
from pocketllm.kernels.gemv import (
    OneRowConfig,
    one_row_candidates,
    skinny_linear,
    skinny_rms_norm_linear,
    skinny_silu_mul_linear,
    time_in_graph,
)
from pocketllm.layers.rotary import RotaryEmbedding

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


def large_batch_variants(heads: int, kv_heads: int, dim: int, batch: int, ctx: int,
                         cache_dtype: torch.dtype = torch.bfloat16, sweep: bool = True) -> None:
    """Decode attention at a large batch (one split) over KV tile, warps, stages and the grid's order (and, for a
    float8 cache, where its codes widen: where loaded, or for the float16 dot products); the context's pages are
    spread over the cache as a long-running server leaves them."""
    pages = ctx // 16 + 1
    k_cache = torch.randn(batch * pages, 16, kv_heads, dim, device="cuda").to(cache_dtype)
    v_cache = torch.randn_like(k_cache, dtype=torch.float32).to(cache_dtype)
    tables = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    nbytes = 2 * batch * ctx * kv_heads * dim * k_cache.element_size()
    fp8 = k_cache.element_size() == 1
    results = []
    for block_n in ((64, 128) if fp8 else (32, 64, 128)) if sweep else ():
        for warps in (4, 8):
            for stages in (2, 3) if fp8 else (2, 3, 4):
                for heads_first in (True,) if fp8 else (False, True):
                    for widen in ("loaded", "fp16") if fp8 else ("-",):
                        def run(b=block_n, w=warps, st=stages, h=heads_first, f=widen) -> torch.Tensor:
                            return paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 1, block_n=b,
                                                num_warps=w, num_stages=st, heads_first=h, fp8_pairs=f == "loaded")
                        try:
                            results.append((us(run), block_n, warps, stages, heads_first, widen))
                        except Exception as exc:  # e.g. out of shared memory
                            print(f"  block_n {block_n} warps {warps} stages {stages}: {type(exc).__name__}")
    results.sort()
    default = us(lambda: paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, 1))
    print(f"attention batch {batch} ctx {ctx}, heads {heads}/{kv_heads}, {cache_dtype} cache: default "
          f"{default:.1f} µs ({nbytes / default / 1e3:,.0f} GB/s); best (µs, GB/s, block_n, warps, stages, "
          "heads first, where float8 codes widen):")
    for t, *rest in results[:8]:
        print(f"    {t:7.1f} {nbytes / t / 1e3:7,.0f}", *rest)
    if fp8:
        for widen in ("loaded", "fp16"):
            print(f"    best widening {widen}:", next((r for r in results if r[-1] == widen), None))


class PackedLayers:
    """``layers`` decode layers' QKV projection and attention inputs (own weights and caches each, so nothing is
    served from L2 across layers), batch rows at context ``ctx`` with pages spread over the cache."""

    def __init__(self, heads: int, kv_heads: int, dim: int, hidden: int, batch: int, ctx: int, qk_norm: bool,
                 layers: int) -> None:
        self.shape = (heads, kv_heads, dim)
        self.batch = batch
        pages = ctx // 16 + 1
        width = (heads + 2 * kv_heads) * dim
        self.weights = [torch.randn(width, hidden, dtype=torch.bfloat16, device="cuda") * 0.02
                        for _ in range(layers)]
        self.caches = [(torch.randn(batch * pages, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda"),
                        torch.randn(batch * pages, 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda"))
                       for _ in range(layers)]
        self.tables = torch.randperm(batch * pages, device="cuda").to(torch.int32).view(batch, pages)
        self.lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        self.positions = torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda")
        last = (ctx - 1) // 16
        self.slots = (self.tables[:, last].to(torch.int64) * 16 + (ctx - 1) % 16).to(torch.int32)
        self.rope = RotaryEmbedding(dim, dim, ctx + 16, 1_000_000.0).to("cuda")
        self.norms = (torch.rand(dim, dtype=torch.bfloat16, device="cuda") + 0.5,
                      torch.rand(dim, dtype=torch.bfloat16, device="cuda") + 0.5) if qk_norm else (None, None)
        self.o_weights = [torch.randn(hidden, heads * dim, dtype=torch.bfloat16, device="cuda") * 0.02
                          for _ in range(layers)]
        self.x = torch.randn(batch, hidden, dtype=torch.bfloat16, device="cuda")
        self.input_norm = torch.rand(hidden, dtype=torch.bfloat16, device="cuda")
        self.splits = decode_splits(batch, kv_heads)
        self.counters = torch.zeros(batch * kv_heads, dtype=torch.int32, device="cuda")

    def qkv(self, weight: torch.Tensor) -> torch.Tensor:
        if self.batch == 1:
            return skinny_rms_norm_linear(self.x, None, self.input_norm, 1e-6, weight)[0]
        return F.linear(rms_norm(self.x, self.input_norm, 1e-6), weight)

    def two_kernels(self, splits: int | None = None, with_o: bool = False, **decode_options) -> None:
        """Per layer: QKV projection, ``qkv_prepare``, ``paged_decode`` (and with ``with_o`` the output
        projection, whose wait on the attention kernel is part of the attention's latency)."""
        heads, kv_heads, dim = self.shape
        for weight, o_weight, (k_cache, v_cache) in zip(self.weights, self.o_weights, self.caches):
            q = qkv_prepare(self.qkv(weight), self.positions, self.rope.cos_cache, self.rope.sin_cache,
                            *self.norms, 1e-6, heads, kv_heads, dim, k_cache, v_cache, self.slots)
            out = paged_decode(q, k_cache, v_cache, self.tables, self.lens, dim ** -0.5, splits or self.splits,
                               counters=self.counters, **decode_options)
            if with_o:
                skinny_linear(out.view(self.batch, -1), o_weight)

    def packed(self, splits: int | None = None, **options) -> None:
        heads, kv_heads, dim = self.shape
        for weight, (k_cache, v_cache) in zip(self.weights, self.caches):
            paged_decode_packed(self.qkv(weight), self.positions, self.rope.cos_cache, self.rope.sin_cache,
                                *self.norms, 1e-6, heads, kv_heads, dim, k_cache, v_cache, self.slots, self.tables,
                                self.lens, dim ** -0.5, splits or self.splits, self.counters, **options)

    def projections_only(self) -> None:
        for weight in self.weights:
            self.qkv(weight)


def kernel_registers(kernel) -> list[str]:
    """Registers and spills of each compiled variant of a Triton kernel (empty where Triton hides them)."""
    found = []
    try:
        for cache in kernel.device_caches.values():
            for compiled in cache[0].values():
                found.append(f"regs {compiled.n_regs} spills {compiled.n_spills}")
    except (AttributeError, IndexError, TypeError):
        pass
    return found


def packed_variants() -> None:
    """µs per layer of QKV projection + attention: qkv_prepare then paged_decode, against the packed kernel
    (first KV tile read before or after the wait; grid in sequence or KV-head order)."""
    layers = 8
    print(f"{'shape':24s} {'proj':>7s} {'two':>7s} {'packed':>7s} {'no pref':>7s} {'other order':>11s} "
          f"{'two S=1':>7s} {'pk S=1':>7s}  µs/layer")
    for name, heads, kv_heads, dim, hidden in (("q06", 16, 8, 128, 1024), ("l8", 32, 8, 128, 4096)):
        for qk_norm in (True, False):
            for batch, ctx in ((1, 256), (1, 1024), (256, 800)):
                case = PackedLayers(heads, kv_heads, dim, hidden, batch, ctx, qk_norm, layers)
                small = batch <= 16
                times = [us(case.projections_only), us(case.two_kernels), us(case.packed),
                         us(partial(case.packed, prefetch=False)), us(partial(case.packed, heads_first=small)),
                         us(partial(case.two_kernels, 1)), us(partial(case.packed, 1))]
                label = f"{name} {'norm' if qk_norm else 'plain'} b{batch} c{ctx}"
                print(f"{label:24s} " + " ".join(f"{t / layers:7.2f}" for t in times[:4])
                      + f" {times[4] / layers:11.2f} " + " ".join(f"{t / layers:7.2f}" for t in times[5:]))
    print("packed kernel variants:", kernel_registers(attention._packed_decode_kernel))
    print("decode kernel variants:", kernel_registers(attention._decode_kernel))


def small_batch_variants() -> None:
    """µs per layer of QKV projection, preparation, decode attention and output projection at batch 1, over
    the attention's KV tile, minimum split length and warps (three stages, splits as the engine picks)."""
    layers = 8
    for name, heads, kv_heads, dim, hidden, qk_norm in (("q06", 16, 8, 128, 1024, True),
                                                        ("l8", 32, 8, 128, 4096, False)):
        for ctx in (128, 256, 1024, 2048):
            case = PackedLayers(heads, kv_heads, dim, hidden, 1, ctx, qk_norm, layers)
            base = us(partial(case.two_kernels, with_o=True)) / layers
            results = []
            for block_n in (32, 64, 128):
                for split_min in sorted({block_n, 256, 512}):
                    for warps in (2, 4, 8):
                        t = us(partial(case.two_kernels, with_o=True, block_n=block_n, split_min=split_min,
                                       num_warps=warps)) / layers
                        results.append((round(t, 2), block_n, split_min, warps))
            results.sort()
            print(f"{name} batch 1 ctx {ctx}: default {base:.2f} µs/layer; best (µs, block_n, split_min, warps):",
                  *results[:5])


def prefill_variants(heads: int, kv_heads: int, dim: int, chunk_tokens: int = 8192) -> None:
    """Prefill attention over one chunk as the throughput workload schedules it (fresh prompts of 100–1024
    tokens filling ``chunk_tokens``), over tile sizes, warps and stages; TFLOP/s counts the causal half."""
    gen = torch.Generator().manual_seed(0)
    lens = []
    while sum(lens) < chunk_tokens:
        lens.append(min(int(torch.randint(100, 1025, (1,), generator=gen)), chunk_tokens - sum(lens)))
    pages = [n // 16 + 1 for n in lens]
    width = max(pages)
    k_cache = torch.randn(sum(pages), 16, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    order = torch.randperm(sum(pages)).to(torch.int32)
    tables = torch.zeros(len(lens), -(-width // 16) * 16, dtype=torch.int32)
    used = 0
    for i, n in enumerate(pages):
        tables[i, :n] = order[used:used + n]
        used += n
    tables = tables.cuda()
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens), heads, dim, dtype=torch.bfloat16, device="cuda")
    flops = sum(2 * 2 * n * n / 2 * dim * heads for n in lens)

    def run(**options) -> torch.Tensor:
        return paged_prefill(q, k_cache, v_cache, tables, ctx, starts, max(lens), dim ** -0.5, **options)

    default = us(run)
    results = []
    for block_m in (64, 128):
        for block_n in (32, 64, 128):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    try:
                        t = us(partial(run, block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages))
                        results.append((t, block_m, block_n, warps, stages))
                    except Exception as exc:  # e.g. out of shared memory
                        print(f"  {block_m} {block_n} {warps} {stages}: {type(exc).__name__}")
    results.sort()
    print(f"prefill {len(lens)} sequences, {sum(lens)} tokens, heads {heads}/{kv_heads}: default {default:.1f} µs "
          f"({flops / default / 1e6:.0f} TFLOP/s); best (µs, TFLOP/s, block_m, block_n, warps, stages):")
    for t, *rest in results[:6]:
        print(f"    {t:7.1f} {flops / t / 1e6:5.0f}", *rest)


def fp8_weight_row(name: str, n: int, k: int) -> None:
    """One weight shape of ``fp8_weight_variants``: the best settings of the sweep, fastest first."""
    bf16 = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    fp8 = [quantize_weight(w) for w in bf16]
    turn = [0]

    def product(config: OneRowConfig, float8: bool = True) -> torch.Tensor:
        turn[0] += 1   # two copies in turn, as every layer brings its own weight
        if not float8:
            return skinny_linear(x, bf16[turn[0] % 2], config)
        codes, scale = fp8[turn[0] % 2]
        return skinny_linear(x, codes, config, scale=scale)

    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    plain = min(us(partial(product, c, False)) for c in one_row_candidates(k))
    now = min(us(partial(product, c)) for c in one_row_candidates(k, True))
    results = []
    for block_n in (1, 2, 4, 8):
        for block_k in (1024, 2048, 4096):
            for warps in (4, 8, 16):
                if block_n * block_k // (32 * warps) >= 8 and block_k <= k:
                    config = OneRowConfig(block_n, block_k, block_n >= 4, warps, 1)   # (each compiles anew)
                    results.append((us(partial(product, config)), config))
    results.sort(key=lambda r: r[0])
    gbs = n * k / 1e3   # bytes of float8 codes per µs, in GB/s
    print(f"{name} [{n}x{k}]: bfloat16 best candidate {plain:.1f} µs ({2 * gbs / plain:.0f} GB/s); float8 "
          f"candidates {now:.1f} µs ({gbs / now:.0f} GB/s); best settings:")
    for t, config in results[:6]:
        print(f"    {t:7.1f} µs {gbs / t:6.0f} GB/s  {config}")


def fp8_weight_variants() -> None:
    """The one-row product (no prologue) on Llama-3-8B's float8 weight shapes over tile rows, tile columns, warps
    and where the products are summed; GB/s of weight codes read, against a device copy and the bfloat16 weight's
    best candidate."""
    size = 1 << 30
    src = torch.empty(size, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_gbs = 2 * size / (time_in_graph(partial(dst.copy_, src), 5) * 1e-3) / 1e9
    print(f"device copy: {copy_gbs:.0f} GB/s (read + write)")
    for name in ("l8 qkv", "l8 o", "l8 gate_up", "l8 down"):
        n, k, _ = PROJECTIONS[name]
        fp8_weight_row(name, n, k)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "fp8-weights":
        fp8_weight_variants()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "small-batch":
        small_batch_variants()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "prefill":
        prefill_variants(16, 8, 128)
        prefill_variants(32, 8, 128)
        return
    if len(sys.argv) > 1 and sys.argv[1] == "packed":
        packed_variants()
        return
    if len(sys.argv) > 1 and sys.argv[1] == "fp8-cache":
        large_batch_variants(16, 8, 128, 256, 800, torch.bfloat16, sweep=False)
        large_batch_variants(16, 8, 128, 256, 800, torch.float8_e4m3fn)
        return
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
