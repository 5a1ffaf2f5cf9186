"""One-row products (batch-1 decode): cuBLAS (F.linear) against the Triton one-row kernel over its launch
settings, on the decode shapes of Qwen3-0.6B and Llama-3-8B, and the device's copy bandwidth (the bound).

    python scripts/bench_gemv.py [PART/PARTS]     # e.g. 0/2 and 1/2 on two GPUs: each times half the settings
    python scripts/bench_gemv.py fp8              # float8 weights (per-row scales), Llama-3-8B's layer shapes

Prints, per shape, cuBLAS, the current default setting and the five fastest settings (µs and GB/s), then
the fused prologues (RMSNorm, SiLU·mul) with the three fastest plain settings of their shape.
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F

from pocketllm.kernels.gemv import (
    OneRowConfig,
    one_row_config,
    skinny_linear,
    skinny_rms_norm_linear,
    skinny_silu_mul_linear,
    time_in_graph,
)

SHAPES = {  # name: (N, K, prologue); qwen3-0.6b then llama3-8b
    "q06 qkv": (4096, 1024, "norm"), "q06 o": (1024, 2048, None), "q06 gate_up": (6144, 1024, "norm"),
    "q06 down": (1024, 3072, "silu"), "q06 lm_head": (151936, 1024, None), "l8 qkv": (6144, 4096, "norm"),
    "l8 o": (4096, 4096, None), "l8 gate_up": (28672, 4096, "norm"), "l8 down": (4096, 14336, "silu"),
    "l8 lm_head": (128256, 4096, None),
}


def settings() -> list[OneRowConfig]:
    out = []
    for bn, bk, warps, stages, reduce_each in itertools.product(
            (1, 2, 4, 8, 16, 32, 64), (128, 256, 512, 1024, 2048), (4, 8), (1, 3), (True, False)):
        if not 512 <= bn * bk <= 16384 or (not reduce_each and bn * bk > 4096):
            continue
        out.append(OneRowConfig(bn, bk, reduce_each, warps, stages))
    return out


def us(fn) -> float:
    return time_in_graph(fn, 30) * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(1 << 30, device="cuda")  # 4 GiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / us(lambda: dst.copy_(src)) / 1e3  # GB/s


def rotating(n: int, k: int, make=lambda n, k: torch.randn(n, k, dtype=torch.bfloat16, device="cuda")):
    """A function returning one of several copies of ``make(n, k)`` (a weight) in turn, so that small weights
    are not timed out of L2 when in a model every layer brings its own weight."""
    weights = [make(n, k) for _ in range(2 if n * k > 3e7 else 8)]
    turn = [0]

    def weight():
        turn[0] += 1
        return weights[turn[0] % len(weights)]

    return weight


def fmt(t: float, nbytes: int) -> str:
    return f"{t:7.1f} µs {nbytes / t / 1e3:6,.0f} GB/s"


def shape_rows(name: str, n: int, k: int, prologue: str | None, configs: list[OneRowConfig]) -> None:
    weight, nbytes = rotating(n, k), n * k * 2
    x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
    cublas = us(lambda: F.linear(x, weight()))
    default = one_row_config(k)
    times = {}
    for c in configs + [default]:
        try:
            times[c] = us(lambda c=c: skinny_linear(x, weight(), c))
        except Exception as exc:  # a setting that does not compile (e.g. out of shared memory)
            print(f"  {name} {c}: {type(exc).__name__}")
    best = sorted(times, key=times.get)
    print(f"{name:12s} N={n} K={k}: cuBLAS {fmt(cublas, nbytes)}; default {fmt(times[default], nbytes)}")
    for c in best[:5]:
        print(f"    {fmt(times[c], nbytes)}  {c}")
    r, nw = torch.randn_like(x), torch.rand(k, dtype=torch.bfloat16, device="cuda")
    gu = torch.randn(1, 2 * k, dtype=torch.bfloat16, device="cuda")
    for c in best[:3] if prologue else ():
        if prologue == "norm":
            t = us(lambda c=c: skinny_rms_norm_linear(x, r, nw, 1e-6, weight(), config=c))
        else:
            t = us(lambda c=c: skinny_silu_mul_linear(gu, weight(), c))
        print(f"    fused {prologue}: {fmt(t, nbytes)}  {c}")


def float8_settings() -> list[OneRowConfig]:
    """Tiles of 4-32 KiB of float8 weight: narrow ones many programs wide, and up to 32 rows a tile (the
    activation is read once per tile, so wider tiles read less of it per weight byte). Also tiles of 2-8 KiB,
    8-32 rows of 256-512 columns, summed once at the end: compiled for sm_90 at 4 warps, 16 × 512 and 32 × 256
    issue 3.6 instructions a weight in their K loop against 4.2-6.3 for the engine's candidates
    (``scripts/one_row_instructions.py``), which may matter where the memory is fast enough for the issue rate
    to bind (an H200 reads float8 weights at 77% of its copy bandwidth where bfloat16 ones reach 97%)."""
    out = []
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8, 16, 32), (1024, 2048, 4096, 8192), (8, 16), (1,)):
        if 4096 <= bn * bk <= 32768:
            out += [OneRowConfig(bn, bk, True, warps, stages)]
            if bn <= 2:
                out += [OneRowConfig(bn, bk, False, warps, stages)]
    for bn, bk, warps in itertools.product((8, 16, 32), (256, 512), (4, 8)):
        if bn * bk <= 8192:
            out += [OneRowConfig(bn, bk, False, warps, 1)]
    return out


def _float8_product(x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor], config: OneRowConfig):
    codes, scale = weight   # one copy's codes with its own scales
    return skinny_linear(x, codes, config, scale=scale)


def float8_rows(name: str, n: int, k: int, configs: list[OneRowConfig],
                plain: OneRowConfig | None = None) -> OneRowConfig:
    """The one-row kernel on a float8 weight of [n, k] over ``configs``, against the engine's candidates; given
    ``plain`` (the plain product's best candidate), the product with the RMSNorm prologue (residual added)
    against the engine's fused candidates for it. Returns the engine's best candidate."""
    from pocketllm.kernels.fp8 import quantize_weight
    from pocketllm.kernels.gemv import fused_candidates, one_row_candidates

    pair = rotating(n, k, lambda n, k: quantize_weight(torch.randn(n, k, device="cuda")))   # (codes, scales)
    x, residual = torch.randn(2, 1, k, dtype=torch.bfloat16, device="cuda")
    norm_weight = torch.rand(k, dtype=torch.bfloat16, device="cuda")
    nbytes = n * k + 4 * n
    times = {}
    norm = plain is not None
    candidates = fused_candidates(k, plain, float8=True) if norm else one_row_candidates(k, float8=True)

    def product(c: OneRowConfig) -> torch.Tensor:
        if norm:
            codes, scale = pair()
            return skinny_rms_norm_linear(x, residual, norm_weight, 1e-6, codes, config=c, scale=scale)[0]
        return _float8_product(x, pair(), c)

    for c in dict.fromkeys(candidates + configs):
        try:
            times[c] = us(lambda c=c: product(c))
        except Exception as exc:  # a setting that does not compile (e.g. out of shared memory)
            print(f"  {name} {c}: {type(exc).__name__}")
    best = sorted(times, key=times.get)
    engine = min((c for c in candidates if c in times), key=times.get)
    label = f"{name}{' + norm' if norm else ''}"
    print(f"{label:19s} N={n} K={k} float8: engine's best candidate {fmt(times[engine], nbytes)}  {engine}")
    for c in best[:6]:
        print(f"    {fmt(times[c], nbytes)}  {c}")
    return engine


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "fp8":
        print(f"copy bandwidth: {copy_bandwidth():,.0f} GB/s (4 GiB, read + write)")
        configs = float8_settings()
        for name in ("l8 qkv", "l8 o", "l8 gate_up", "l8 down", "l8 lm_head"):
            plain = float8_rows(name, *SHAPES[name][:2], configs)
            if SHAPES[name][2] == "norm":
                float8_rows(name, *SHAPES[name][:2], configs, plain)
        return
    part, parts = (int(v) for v in (sys.argv[1].split("/") if len(sys.argv) > 1 else ("0", "1")))
    configs = settings()[part::parts]
    print(f"copy bandwidth: {copy_bandwidth():,.0f} GB/s (4 GiB, read + write); {len(configs)} settings")
    for name, (n, k, prologue) in SHAPES.items():
        shape_rows(name, n, k, prologue, configs)


if __name__ == "__main__":
    main()
