"""Mixture-of-experts expert products as two grouped launches (CUDA), with no host synchronisation.

The routed (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M``; one program computes a ``[BLOCK_M, BLOCK_N]`` tile of one expert's product, reading that
expert's weight once for up to ``BLOCK_M`` tokens. All bookkeeping (counts, offsets, the padded order and the
expert of every row block) is computed on the device with static shapes — the padded length is bounded by
``pairs + experts * (BLOCK_M - 1)`` — so a decode step with MoE layers can be captured in a CUDA graph;
blocks past the used length carry expert -1 and return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_kernel(a_ptr, b_ptr, out_ptr, rows_ptr, block_expert_ptr, scale_ptr, num_pairs, N, K,
                    stride_a, stride_be, stride_bn, stride_out,
                    ROW_DIV: tl.constexpr, SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(rows_ptr + offs_m)                       # (token * top_k + j), or num_pairs as padding
    valid = pair < num_pairs
    a_row = (pair // ROW_DIV).to(tl.int64)                 # input row: the token, or the pair itself
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    b_base = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptr + a_row[:, None] * stride_a + (k0 + offs_k)[None, :],
                    mask=valid[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_base + (k0 + offs_k)[:, None], mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if SCALE:
        acc = acc * tl.load(scale_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pair.to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_mask[None, :])


def _grouped(a: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, block_expert: torch.Tensor,
             num_pairs: int, row_div: int, scale: torch.Tensor | None, block_m: int) -> torch.Tensor:
    """``out[p] = a[p // row_div] @ weight[expert(p)].T`` (times ``scale[p]``) for every routed pair ``p``."""
    n, k = weight.shape[1], weight.shape[2]
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = 64, 64
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_kernel[grid](a, weight, out, rows, block_expert, scale if scale is not None else out, num_pairs, n, k,
                          a.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                          ROW_DIV=row_div, SCALE=scale is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                          BLOCK_K=block_k, PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                          num_warps=4, num_stages=3)
    return out


def _block_layout(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(padded pair order [padded_len] int32, expert of each row block [padded_len / block_m] int32)."""
    flat = experts.flatten().long()
    pairs = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    sorted_expert = flat[order]
    rank = torch.arange(pairs, device=device) - count_start[sorted_expert]
    max_len = -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m
    rows = torch.full((max_len,), pairs, dtype=torch.int32, device=device)
    rows.index_copy_(0, pad_start[sorted_expert] + rank, order.to(torch.int32))
    block_start = torch.arange(0, max_len, block_m, device=device)
    block_expert = torch.searchsorted(pad_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


def fused_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                  experts: torch.Tensor, swiglu_limit: float | None = None) -> torch.Tensor:
    """SwiGLU experts: ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = experts[t, j]``.

    ``hidden`` [T, H], ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I], ``weights`` and
    ``experts`` [T, top_k]. Returns [T, H] in ``hidden``'s dtype. ``swiglu_limit`` (DeepSeek-V4): the gate
    clamped from above and the up projection to ±limit before the product.
    """
    from pocketllm.kernels.fused import silu_and_mul

    tokens, top_k = experts.shape
    pairs = tokens * top_k
    num_experts = w13.shape[0]
    block_m = 16 if pairs <= 4 * num_experts else 64
    rows, block_expert = _block_layout(experts, num_experts, block_m)
    hidden = hidden.contiguous()
    gate_up = _grouped(hidden, w13, rows, block_expert, pairs, top_k, None, block_m)
    if swiglu_limit is None:
        act = silu_and_mul(gate_up)
    else:
        gate, up = gate_up.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate.clamp(max=swiglu_limit)) * up.clamp(-swiglu_limit, swiglu_limit)
    scale = weights.flatten().contiguous()
    down = _grouped(act, w2, rows, block_expert, pairs, 1, scale, block_m)
    return down.view(tokens, top_k, -1).sum(dim=1)
