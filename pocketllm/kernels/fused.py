"""Fused elementwise kernels: RMSNorm (+residual), SiLU·mul, and the attention input preparation.

Each replaces several PyTorch launches on the decode path, where a step is a few hundred tiny kernels
and launch count, not bytes, sets the time. Arithmetic is float32 inside; results are rounded to the
model dtype at the points where the PyTorch reference rounds (the residual sum, the norm output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


def _pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def _warps(width: int) -> int:
    return 1 if width <= 256 else 4 if width <= 2048 else 8


# ------------------------------------------------------------------------------------------------ RMSNorm

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)  # the reference adds in the model dtype
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    y = xf * tl.rsqrt(var + eps) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             offset: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or with ``residual`` ``(norm(x + residual), x + residual)``; last dimension normalised.
    ``offset`` scales by ``1 + weight`` (zero-centred norm weights)."""
    shape = x.shape
    n = shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n)
    pdl, launch = launch_options(x, rows)
    if residual is None:
        if rows:
            _rms_norm_kernel[(rows,)](x2, x2, weight, out2, out2, x2.stride(0), 0, out2.stride(0), n, eps,
                                      HAS_RESIDUAL=False, OFFSET=offset, BLOCK=_pow2(n), num_warps=_warps(n),
                                      PDL=pdl, **launch)
        return out
    r2 = residual.reshape(-1, n)
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    summed = torch.empty(shape, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, out2, summed.view(-1, n), x2.stride(0), r2.stride(0),
                                  out2.stride(0), n, eps, HAS_RESIDUAL=True, OFFSET=offset, BLOCK=_pow2(n),
                                  num_warps=_warps(n), PDL=pdl, **launch)
    return out, summed


# ------------------------------------------------------------------------------------------------ SiLU·mul

@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` [..., 2n]."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    if rows:
        block = min(1024, _pow2(n))
        pdl, launch = launch_options(x, rows)
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](x2, out.view(-1, n), x2.stride(0), n, n, BLOCK=block,
                                                         num_warps=4, PDL=pdl, **launch)
    return out


# ------------------------------------------------------------------------------------ attention input prep

@triton.jit
def _qkv_prep_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                     slot_ptr, stride_qkv, stride_cos, eps,
                     NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HALF_PAD: tl.constexpr, HEADS: tl.constexpr, HAS_NORM: tl.constexpr, PDL: tl.constexpr):
    """``HEADS`` consecutive heads of one token (rows of a tile; q, k and v heads alike): each row is split in
    halves for the rotate-half rotation, q and k rows are normalised and rotated, k and v rows stored."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    half: tl.constexpr = HEAD_DIM // 2
    cols = tl.arange(0, HALF_PAD)
    cmask = cols < half
    is_q = head < NUM_HEADS
    is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
    is_v = (head >= NUM_HEADS + NUM_KV_HEADS) & (head < NUM_HEADS + 2 * NUM_KV_HEADS)
    mask = (is_q | is_k | is_v)[:, None] & cmask[None, :]
    # The step's positions and slots (a host copy), the rotary row and the norm weights are read before waiting
    # on the projection that wrote ``qkv``.
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + cols, mask=cmask, other=0.0)[None, :]
    if HAS_NORM:
        wq1 = tl.load(qw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        wq2 = tl.load(qw_ptr + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        wk1 = tl.load(kw_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        wk2 = tl.load(kw_ptr + half + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if PDL:
        gdc_wait()
    src = qkv_ptr + tok * stride_qkv + head[:, None] * HEAD_DIM + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + half, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        r = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / HEAD_DIM + eps)[:, None]
        # the reference rounds the norm's output to the model dtype before the rotation
        a = (a * r * tl.where(is_q[:, None], wq1, wk1)).to(x1.dtype).to(tl.float32)
        b = (b * r * tl.where(is_q[:, None], wq2, wk2)).to(x1.dtype).to(tl.float32)
    o1 = a * c - b * s
    o2 = b * c + a * s
    q_dst = q_out_ptr + tok * (NUM_HEADS * HEAD_DIM) + head[:, None] * HEAD_DIM + cols[None, :]
    q_mask = is_q[:, None] & cmask[None, :]
    tl.store(q_dst, o1.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_dst + half, o2.to(q_out_ptr.dtype.element_ty), mask=q_mask)
    stored = slot + head * 0 >= 0        # (a per-row condition: a scalar mask fails in Triton's interpreter)
    kv_row = NUM_KV_HEADS * HEAD_DIM
    k_dst = k_cache_ptr + slot * kv_row + (head - NUM_HEADS)[:, None] * HEAD_DIM + cols[None, :]
    k_mask = (is_k & stored)[:, None] & cmask[None, :]
    tl.store(k_dst, o1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_dst + half, o2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    v_dst = v_cache_ptr + slot * kv_row + (head - NUM_HEADS - NUM_KV_HEADS)[:, None] * HEAD_DIM + cols[None, :]
    v_mask = (is_v & stored)[:, None] & cmask[None, :]
    tl.store(v_dst, x1.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=v_mask)
    tl.store(v_dst + half, x2.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def qkv_prepare(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, num_heads: int,
                num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> torch.Tensor:
    """One launch for: split ``qkv`` [T, (H + 2 KVH) * D], per-head RMSNorm of q and k (when weights are
    given), rotary embedding of q and k (rotate-half layout over the whole head), and the store of k and v
    into their cache slots. Returns q as [T, H, D]."""
    tokens = qkv.shape[0]
    assert qkv.stride(1) == 1 and head_dim % 2 == 0
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    has_norm = q_weight is not None
    qw = q_weight if has_norm else qkv
    kw = k_weight if has_norm else qkv
    pdl, launch = launch_options(qkv, tokens)
    # One head per program for a few tokens (parallelism); several for many tokens: one-warp programs of one
    # head each filled the GPU's program slots about twice at 256 tokens (6.9 µs a launch).
    heads = 1 if tokens <= 16 else 4
    total = num_heads + 2 * num_kv_heads
    _qkv_prep_kernel[(tokens, triton.cdiv(total, heads))](
        qkv, positions, cos_cache, sin_cache, qw, kw, q, k_cache, v_cache, slot_mapping,
        qkv.stride(0), cos_cache.stride(0), eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF_PAD=_pow2(head_dim // 2),
        HEADS=heads, HAS_NORM=has_norm, num_warps=1 if heads == 1 else 2, PDL=pdl, **launch)
    return q


# ------------------------------------------------------------------- gated attention (Qwen3.5) input prep

@triton.jit
def _norm_rotate_head(src, w_ptr, cos_row, sin_row, d, dmask, eps, D: tl.constexpr, ROT: tl.constexpr,
                      OFFSET: tl.constexpr):
    """One head's RMSNorm (``1 + w`` with ``OFFSET``; the output rounded to the model dtype, as the reference
    rounds) and the rotate-half rotary embedding of its first ``ROT`` channels, in float32."""
    x = tl.load(src + d, mask=dmask, other=0.0)
    xf = x.to(tl.float32)
    r = tl.rsqrt(tl.sum(xf * xf, 0) / D + eps)
    w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)
    if OFFSET:
        w = w + 1.0
    normed = (xf * r * w).to(x.dtype).to(tl.float32)
    half: tl.constexpr = ROT // 2
    rot = d < ROT
    partner = tl.where(d < half, d + half, d - half)
    xp = tl.load(src + partner, mask=rot, other=0.0)
    wp = tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32)
    if OFFSET:
        wp = wp + 1.0
    normed_p = (xp.to(tl.float32) * r * wp).to(x.dtype).to(tl.float32)
    c = tl.load(cos_row + d, mask=rot, other=1.0)
    s = tl.load(sin_row + d, mask=rot, other=0.0)
    return tl.where(rot, normed * c + tl.where(d < half, -normed_p, normed_p) * s, normed)


@triton.jit
def _gated_qkv_prep_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                           slot_ptr, stride_qkv, stride_cos, eps, NUM_HEADS: tl.constexpr,
                           NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr,
                           OFFSET: tl.constexpr, PDL: tl.constexpr):
    """One head of one token of the gated projection [q_0 | gate_0 | q_1 | gate_1 ... | k | v]: q heads normed
    and rotated into ``q_out``; k heads normed, rotated and stored; v heads stored (gates stay in place)."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos_row = cos_ptr + pos * stride_cos
    sin_row = sin_ptr + pos * stride_cos
    if PDL:
        gdc_wait()
    row = qkv_ptr + tok * stride_qkv
    kv_row = NUM_KV_HEADS * D
    stored = dmask & (slot + d * 0 >= 0)   # (a per-channel condition: a scalar mask fails in the interpreter)
    if head < NUM_HEADS:
        out = _norm_rotate_head(row + head * 2 * D, qw_ptr, cos_row, sin_row, d, dmask, eps, D, ROT, OFFSET)
        tl.store(q_out_ptr + tok * NUM_HEADS * D + head * D + d, out.to(q_out_ptr.dtype.element_ty), mask=dmask)
    elif head < NUM_HEADS + NUM_KV_HEADS:
        kh = head - NUM_HEADS
        out = _norm_rotate_head(row + NUM_HEADS * 2 * D + kh * D, kw_ptr, cos_row, sin_row, d, dmask, eps, D, ROT,
                                OFFSET)
        tl.store(k_cache_ptr + slot * kv_row + kh * D + d, out.to(k_cache_ptr.dtype.element_ty), mask=stored)
    else:
        vh = head - NUM_HEADS - NUM_KV_HEADS
        v = tl.load(row + NUM_HEADS * 2 * D + kv_row + vh * D + d, mask=dmask, other=0.0)
        tl.store(v_cache_ptr + slot * kv_row + vh * D + d, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty),
                 mask=stored)


def gated_qkv_prepare(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor, sin_cache: torch.Tensor,
                      q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float, offset: bool, num_heads: int,
                      num_kv_heads: int, head_dim: int, rotary_dim: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """One launch for Qwen3.5's gated attention input: from ``qkv`` [T, H * 2D + 2 KVH * D] (each q head's D
    query channels, then its D gate channels), per-head RMSNorm of q and k (``1 + weight`` with ``offset``),
    rotary embedding of their first ``rotary_dim`` channels (rotate-half), and the store of k and v into their
    cache slots. Returns q as [T, H, D]; the gates are read from ``qkv`` later (``sigmoid_gate``)."""
    tokens = qkv.shape[0]
    if qkv.stride(1) != 1 or rotary_dim % 2 or rotary_dim > head_dim or cos_cache.shape[1] < rotary_dim:
        raise ValueError("gated_qkv_prepare needs contiguous rows and an even rotary width within the head")
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    pdl, launch = launch_options(qkv, tokens)
    block = _pow2(head_dim)
    _gated_qkv_prep_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos_cache, sin_cache, q_weight, k_weight, q, k_cache, v_cache, slot_mapping, qkv.stride(0),
        cos_cache.stride(0), eps, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, D=head_dim, ROT=rotary_dim,
        BLOCK_D=block, OFFSET=offset, PDL=pdl, num_warps=1 if block <= 256 else 2, **launch)
    return q


@triton.jit
def _sigmoid_gate_kernel(x_ptr, qkv_ptr, out_ptr, stride_qkv, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         PDL: tl.constexpr):
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
        gdc_wait()
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    heads = tl.num_programs(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < D
    x = tl.load(x_ptr + tok * heads * D + head * D + d, mask=mask, other=0.0)
    g = tl.load(qkv_ptr + tok * stride_qkv + head * 2 * D + D + d, mask=mask, other=0.0).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-g))).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + tok * heads * D + head * D + d, (x.to(tl.float32) * gate).to(x.dtype), mask=mask)


def sigmoid_gate(x: torch.Tensor, qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """``x * sigmoid(gate)`` for the attention output ``x`` [T, H * D], the gates read in place from the gated
    projection ``qkv`` (the D channels after each q head's), rounded as the reference rounds."""
    tokens = x.shape[0]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    if not x.is_contiguous() or qkv.stride(1) != 1:
        raise ValueError("sigmoid_gate needs contiguous rows")
    pdl, launch = launch_options(x, tokens)
    block = _pow2(head_dim)
    _sigmoid_gate_kernel[(tokens, num_heads)](x, qkv, out, qkv.stride(0), D=head_dim, BLOCK_D=block, PDL=pdl,
                                              num_warps=1 if block <= 256 else 2, **launch)
    return out
