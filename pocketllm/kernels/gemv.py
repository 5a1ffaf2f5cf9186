"""Skinny matrix products (a few rows of activations times a large weight), for decode at small batch.

At one to sixteen rows a linear layer is a pass over its weight: its time is the weight's bytes over memory
bandwidth. cuBLAS's choice for these shapes was measured on an H200 at about 1 TB/s for the 151936 × 1024
LM head of Qwen3-0.6B; this kernel streams the weight in [BLOCK_N, BLOCK_K] tiles, many programs wide.
``skinny_rows_for`` times both on the actual weight and says up to how many rows to use it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    if BLOCK_M == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptr + k0 + rk, mask=k_mask, other=0.0).to(tl.float32)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        out = tl.sum(acc, 1)
        tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        rm = tl.arange(0, BLOCK_M)
        m_mask = rm < M
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            x = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + rk)[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w))
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


MAX_ROWS = 16


def one_row_blocks(n: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for one activation row: about 256 programs or more, each streaming a few whole weight
    rows, so that a small matrix (a few MB) still spreads over every multiprocessor."""
    block_n = 4
    while block_n < 64 and n // (2 * block_n) >= 256:
        block_n *= 2
    return block_n, max(128, 4096 // block_n)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None,
                  num_stages: int = 4) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [M ≤ 16, K] and ``weight`` [N, K] (row-major), bf16/fp16 (fp32 accumulate)."""
    m, k = x.shape
    n = weight.shape[0]
    if block_n is None or block_k is None:
        auto_n, auto_k = one_row_blocks(n) if m == 1 else (64, 128)
        block_n, block_k = block_n or auto_n, block_k or auto_k
    assert m <= MAX_ROWS and weight.stride(1) == 1
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 1 if m == 1 else 16
    _skinny_kernel[(triton.cdiv(n, block_n),)](x, weight, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
                                               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
                                               num_stages=num_stages)
    return out


def time_in_graph(fn, repeats: int = 20) -> float:
    """Device milliseconds per call of ``fn``, replayed from a CUDA graph of ``repeats`` calls: small kernels
    are timed as a model's decode graph runs them, without the host's launch cost in the way."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (3 * repeats)


def skinny_rows_for(weight: torch.Tensor) -> int:
    """Most rows (1, 2, 4, 8 or 16; 0 = none) up to which the skinny kernel beats ``F.linear`` by 5% on this
    weight's shape, timed on the weight (and, for small weights, on copies in turn, so that neither side is
    timed out of L2 when in a model every layer brings its own weight)."""
    if weight.dtype not in (torch.bfloat16, torch.float16) or weight.dim() != 2 or weight.stride(1) != 1:
        return 0
    copies = [weight]
    if weight.numel() * weight.element_size() < (64 << 20):
        copies += [torch.randn_like(weight) for _ in range(7)]
    turn = [0]

    def next_weight() -> torch.Tensor:
        turn[0] += 1
        return copies[turn[0] % len(copies)]

    rows = 0
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, weight.shape[1], dtype=weight.dtype, device=weight.device)
        ours = time_in_graph(lambda x=x: skinny_linear(x, next_weight()))
        theirs = time_in_graph(lambda x=x: torch.nn.functional.linear(x, next_weight()))
        if ours >= 0.95 * theirs:
            break
        rows = m
    return rows
