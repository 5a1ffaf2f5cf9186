"""Mixture-of-experts expert products as two grouped launches (CUDA), with no host synchronisation.

The routed (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
``BLOCK_M``; one program computes a ``[BLOCK_M, BLOCK_N]`` tile of one expert's product, reading that
expert's weight once for up to ``BLOCK_M`` tokens. All bookkeeping (counts, offsets, the padded order and the
expert of every row block) is computed on the device with static shapes — the padded length is bounded by
``pairs + experts * (BLOCK_M - 1)`` — so a decode step with MoE layers can be captured in a CUDA graph;
blocks past the used length carry expert -1 and return at once.

A decode step of a few tokens (``FEW_TOKENS``) skips all of that: there are fewer routed pairs than experts, so no
expert's weight is shared, and the bookkeeping (a sort, scans, a search: about a dozen small launches a layer)
cost more than the products. Each pair's program reads its expert id on the device and streams that expert's
weight rows as the one-row products do (``kernels/gemv.py``): one launch for [gate; up] with SiLU·mul, one for
the down projection times the routing weight, then a sum over the token's pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options

# A gated shared expert beside the routed ones (Qwen3.5-MoE): (gate logit [T, 1], its output [T, H]); the layer's
# output is the routed sum plus ``sigmoid(gate) * output``.
SharedTerm = tuple[torch.Tensor, torch.Tensor]


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, experts_ptr, num_experts, stride_l, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """One token: softmax of its router logits in float32, its ``TOP_K`` largest probabilities in descending
    order (the lower expert index first among equal ones), optionally renormalised to sum to one."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=-float("inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, 0))
    e = tl.where(valid, e, 0.0)
    probs = e / tl.sum(e, 0)
    probs = tl.where(valid, probs, -1.0)
    ks = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_K], dtype=tl.float32)
    index = tl.zeros([BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(probs, 0)
        at = tl.min(tl.where(probs == best, offs, BLOCK_E), 0)
        chosen = tl.where(ks == j, best, chosen)
        index = tl.where(ks == j, at.to(tl.int64), index)
        probs = tl.where(offs == at, -1.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(chosen, 0)
    tl.store(weights_ptr + t * TOP_K + ks, chosen.to(weights_ptr.dtype.element_ty), mask=ks < TOP_K)
    tl.store(experts_ptr + t * TOP_K + ks, index, mask=ks < TOP_K)


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, top_k] in the logits' dtype, experts [T, top_k] int64): ``FusedMoE.route`` in one launch."""
    tokens, num_experts = router_logits.shape
    weights = torch.empty(tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    experts = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens == 0:
        return weights, experts
    if router_logits.stride(1) != 1 or not 0 < top_k <= num_experts:
        raise ValueError(f"route_top_k needs contiguous logit rows and 0 < top_k <= {num_experts}")
    pdl, launch = launch_options(router_logits, tokens)
    block = triton.next_power_of_2(num_experts)
    _route_kernel[(tokens,)](router_logits, weights, experts, num_experts, router_logits.stride(0), TOP_K=top_k,
                             RENORMALIZE=renormalize, BLOCK_E=block, BLOCK_K=triton.next_power_of_2(top_k), PDL=pdl,
                             num_warps=4 if block >= 512 else 2,
                             **launch)
    return weights, experts


@triton.jit
def _pair_sum_kernel(pairs_ptr, out_ptr, gate_ptr, shared_ptr, N, stride_gate, stride_shared, TOP_K: tl.constexpr,
                     SHARED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out[t] = sum_j pairs[t * TOP_K + j]`` rounded to the output dtype, then with ``SHARED`` plus
    ``sigmoid(gate[t]) * shared[t]``, rounded where the unfused layer rounds (sigmoid, product, sum)."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * N + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    y = acc.to(dtype)
    if SHARED:
        g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
        scale = (1.0 / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        shared = tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
        y = (y.to(tl.float32) + (scale * shared).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + t * N + cols, y, mask=mask)


def sum_pairs(pairs: torch.Tensor, top_k: int, dtype: torch.dtype, shared: SharedTerm | None = None) -> torch.Tensor:
    """[T, H] in ``dtype``: each token's ``top_k`` consecutive rows of ``pairs`` [T * top_k, H] summed, plus the
    gated shared expert's output when ``shared`` is given."""
    rows, n = pairs.shape
    tokens = rows // top_k
    out = torch.empty(tokens, n, dtype=dtype, device=pairs.device)
    if tokens == 0:
        return out
    gate, shared_out = shared if shared is not None else (out, out)
    if pairs.stride(0) != n or shared_out.stride(-1) != 1 or gate.dim() != 2:
        raise ValueError("sum_pairs needs contiguous pair rows and shared-expert rows")
    pdl, launch = launch_options(pairs, tokens)
    block = min(1024, triton.next_power_of_2(n))
    _pair_sum_kernel[(tokens, triton.cdiv(n, block))](
        pairs, out, gate, shared_out, n, gate.stride(0), shared_out.stride(0), TOP_K=top_k, SHARED=shared is not None,
        BLOCK=block, PDL=pdl, num_warps=4, **launch)
    return out



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


# Most tokens of a step whose experts run one program per routed pair (no sort); more go through the grouped tiles.
FEW_TOKENS = 4


@triton.jit
def _pair_rows(w_ptr, experts_ptr, n, stride_we, stride_wn, BLOCK_N: tl.constexpr):
    """(routed pair, row indices, their mask, row pointers [BLOCK_N, 1]) of a program over row block
    ``program_id(1)`` of pair ``program_id(0)``'s expert weight (``n`` rows)."""
    p = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    expert = tl.load(experts_ptr + p).to(tl.int64)
    return p, rn, rn < n, w_ptr + expert * stride_we + rn.to(tl.int64)[:, None] * stride_wn


@triton.jit
def _few_gate_up_kernel(x_ptr, w13_ptr, experts_ptr, act_ptr, inter, K, stride_x, stride_we, stride_wn, limit,
                        TOP_K: tl.constexpr, CLAMP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr):
    """``act[p, n] = silu(gate) * up`` over ``BLOCK_N`` rows ``n`` of routed pair ``p``'s expert (token ``p //
    TOP_K``); gate and up are rounded to the activations' dtype first, as the unfused products are."""
    if PDL:   # launched early; everything it reads first (the pair's expert) an earlier kernel of the step wrote
        gdc_launch_dependents()
        gdc_wait()
    p, rn, n_mask, gate_rows = _pair_rows(w13_ptr, experts_ptr, inter, stride_we, stride_wn, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    up_rows = gate_rows + inter * stride_wn
    x_row = x_ptr + (p // TOP_K).to(tl.int64) * stride_x
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ck = k0 + rk
        k_mask = ck < K
        x = tl.load(x_row + ck, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        mask = n_mask[:, None] & k_mask[None, :]
        gate += tl.sum(tl.load(gate_rows + ck[None, :], mask=mask, other=0.0).to(tl.float32) * x, 1)
        up += tl.sum(tl.load(up_rows + ck[None, :], mask=mask, other=0.0).to(tl.float32) * x, 1)
    dtype = act_ptr.dtype.element_ty
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if CLAMP:   # DeepSeek-V4: the gate clamped from above, up to ±limit
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(act_ptr + p.to(tl.int64) * inter + rn, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=n_mask)


@triton.jit
def _few_down_kernel(act_ptr, w2_ptr, experts_ptr, weights_ptr, out_ptr, N, inter, stride_we, stride_wn,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """``out[p, n] = weight[p] * (act[p] @ w2[expert(p)].T)[n]`` in float32 (the product rounded to the
    activations' dtype first)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    p, rn, n_mask, rows = _pair_rows(w2_ptr, experts_ptr, N, stride_we, stride_wn, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    act_row = act_ptr + p.to(tl.int64) * inter
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ck = k0 + rk
        k_mask = ck < inter
        a = tl.load(act_row + ck, mask=k_mask, other=0.0).to(tl.float32)[None, :]
        acc += tl.sum(tl.load(rows + ck[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                      * a, 1)
    y = acc.to(act_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + p).to(tl.float32)
    tl.store(out_ptr + p.to(tl.int64) * N + rn, y, mask=n_mask)


def few_token_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                      experts: torch.Tensor, swiglu_limit: float | None = None,
                      shared: SharedTerm | None = None) -> torch.Tensor:
    """What ``fused_experts`` computes, one program per routed pair and weight-row block (three launches, no
    bookkeeping): for a few tokens, whose pairs share no expert weight worth reading once."""
    tokens, top_k = experts.shape
    pairs = tokens * top_k
    inter, hidden_size = w13.shape[1] // 2, w13.shape[2]
    hidden = hidden.contiguous()
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("the expert weights need contiguous rows")
    flat_experts = experts.reshape(-1).contiguous()
    act = torch.empty(pairs, inter, dtype=hidden.dtype, device=hidden.device)
    pdl, launch = launch_options(hidden, tokens)
    block_k = min(1024, triton.next_power_of_2(hidden_size))
    _few_gate_up_kernel[(pairs, triton.cdiv(inter, 4))](
        hidden, w13, flat_experts, act, inter, hidden_size, hidden.stride(0), w13.stride(0), w13.stride(1),
        float(swiglu_limit or 0.0), TOP_K=top_k, CLAMP=swiglu_limit is not None, BLOCK_N=4, BLOCK_K=block_k,
        PDL=pdl, num_warps=4, **launch)
    out = torch.empty(pairs, hidden_size, dtype=torch.float32, device=hidden.device)
    block_k = min(512, triton.next_power_of_2(inter))
    _few_down_kernel[(pairs, triton.cdiv(hidden_size, 16))](
        act, w2, flat_experts, weights.reshape(-1).contiguous(), out, hidden_size, inter, w2.stride(0),
        w2.stride(1), BLOCK_N=16, BLOCK_K=block_k, PDL=pdl, num_warps=4, **launch)
    return sum_pairs(out, top_k, hidden.dtype, shared)


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
                  experts: torch.Tensor, swiglu_limit: float | None = None,
                  shared: SharedTerm | None = None) -> torch.Tensor:
    """SwiGLU experts: ``sum_j weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = experts[t, j]``.

    ``hidden`` [T, H], ``w13`` [E, 2I, H] (gate rows then up rows), ``w2`` [E, H, I], ``weights`` and
    ``experts`` [T, top_k]. Returns [T, H] in ``hidden``'s dtype. ``swiglu_limit`` (DeepSeek-V4): the gate
    clamped from above and the up projection to ±limit before the product. ``shared``: a gated shared expert's
    term added in the same launch as the sum over a token's pairs. Up to ``FEW_TOKENS`` tokens run one
    program per routed pair (``few_token_experts``), more the grouped tiles (``grouped_experts``).
    """
    if experts.shape[0] <= FEW_TOKENS:
        return few_token_experts(hidden, w13, w2, weights, experts, swiglu_limit, shared)
    return grouped_experts(hidden, w13, w2, weights, experts, swiglu_limit, shared)


def grouped_experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor, swiglu_limit: float | None = None,
                    shared: SharedTerm | None = None) -> torch.Tensor:
    """What ``fused_experts`` computes, as the two grouped launches over the pairs sorted by expert."""
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
    return sum_pairs(down, top_k, hidden.dtype, shared)
