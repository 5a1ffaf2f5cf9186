"""The gated delta rule over a flat batch of prompt chunks in one launch (CUDA): Gated DeltaNet prefill without
the optional ``fla`` package (the PyTorch reference is ``chunk_gated_delta_rule`` in ``layers/gated_delta.py``).

One program per (sequence, value head, value block) walks its sequence in chunks of ``CHUNK`` tokens, keeping
its state tile ``S`` [key_dim, BLOCK_V] in float32 registers from the sequence's slot (zeros when it starts
fresh) to the end, where it is written back. Inside a chunk, with ``c`` the cumulative log-decay from the chunk
start and ``A[i, j] = beta_i e^(c_i - c_j) k_i.k_j`` for ``j < i``, the delta-rule writes are
``d = (I + A)^-1 beta (v - e^c (k S))``; ``(I + A)^-1`` is built row by row (forward substitution on a
CHUNK x CHUNK tile), everything else is tile products (the value blocks of a head each repeat the chunk's
key products and inverse, which do not depend on the values):

    o = (q e^c) S + ((q k^T) * e^(c_i - c_j), j <= i) d
    S = e^(c_last) S + (k e^(c_last - c))^T d

Queries and keys arrive raw (after the conv and SiLU) and are L2-normalised here (the query also scaled);
value head ``h`` reads key head ``h // (value_heads / key_heads)``. Rows past a sequence's end load as zeros,
with zero gate and beta, which write nothing and keep the state.

The causal conv1d before it (``conv_prefill``) is flat too, in two launches: the outputs (conv, then SiLU,
rounded as the reference rounds) of every token, whose first ``K - 1`` taps reach into the sequence's conv-state
slot, then each sequence's new conv state (its last ``K - 1`` inputs), written once every output has read the
old one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 16


@triton.jit
def _unit_lower_inverse(a, CHUNK_: tl.constexpr):
    """``(I + a)^-1`` for a strictly lower-triangular [CHUNK, CHUNK] tile: row ``i`` is ``e_i - a[i, :] @ T``
    over the rows before it, which are final by then."""
    r = tl.arange(0, CHUNK_)
    t = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    for i in tl.static_range(1, CHUNK_):
        a_row = tl.sum(tl.where(r[:, None] == i, a, 0.0), 0)    # a[i, :], indexed by column j
        combined = tl.sum(a_row[:, None] * t, 0)                 # sum_j a[i, j] * t[j, :]
        t = tl.where(r[:, None] == i, tl.where(r == i, 1.0, 0.0)[None, :] - combined[None, :], t)
    return t


@triton.jit
def _chunk_rule_kernel(q_ptr, k_ptr, v_ptr, stride_qk, stride_v, g_ptr, beta_ptr, stride_gb, state_ptr,
                       stride_ss, stride_sh, cu_ptr, slot_ptr, keep_ptr, out_ptr, stride_ot, stride_oh, scale,
                       GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
                       CHUNK_: tl.constexpr, PRECISION: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    v0 = tl.program_id(2) * BLOCK_V
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    keep = tl.load(keep_ptr + seq) != 0
    kh = head // GROUP
    dk = tl.arange(0, DK)
    dv = v0 + tl.arange(0, BLOCK_V)
    dv_mask = dv < DV
    ri = tl.arange(0, CHUNK_)
    tile = state_ptr + slot * stride_ss + head * stride_sh + dk[:, None] * DV + dv[None, :]
    s = tl.load(tile, mask=dv_mask[None, :], other=0.0)
    s = tl.where(keep, s, 0.0)
    lower = ri[:, None] > ri[None, :]
    causal = ri[:, None] >= ri[None, :]
    for c0 in range(start, end, CHUNK_):
        rows = c0 + ri
        valid = rows < end
        rows64 = rows.to(tl.int64)
        q = tl.load(q_ptr + rows64[:, None] * stride_qk + kh * DK + dk[None, :], mask=valid[:, None],
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + rows64[:, None] * stride_qk + kh * DK + dk[None, :], mask=valid[:, None],
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + rows64[:, None] * stride_v + head * DV + dv[None, :],
                    mask=valid[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + rows64 * stride_gb + head, mask=valid, other=0.0)
        beta = tl.load(beta_ptr + rows64 * stride_gb + head, mask=valid, other=0.0)
        q = q * tl.rsqrt(tl.sum(q * q, 1) + 1e-6)[:, None] * scale
        k = k * tl.rsqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
        c = tl.cumsum(g, 0)
        c_last = tl.sum(g, 0)
        gaps = c[:, None] - c[None, :]
        kk = tl.dot(k, tl.trans(k), input_precision=PRECISION)
        a = tl.where(lower, kk * tl.exp(tl.where(lower, gaps, 0.0)) * beta[:, None], 0.0)
        inverse = _unit_lower_inverse(a, CHUNK_)
        ks = tl.dot(k, s, input_precision=PRECISION)
        rhs = beta[:, None] * (v - tl.exp(c)[:, None] * ks)
        d = tl.dot(inverse, rhs, input_precision=PRECISION)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(causal, qk * tl.exp(tl.where(causal, gaps, 0.0)), 0.0)
        o = tl.dot(q * tl.exp(c)[:, None], s, input_precision=PRECISION)
        o += tl.dot(scores, d, input_precision=PRECISION)
        tl.store(out_ptr + rows64[:, None] * stride_ot + head * stride_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dv_mask[None, :])
        k_to_end = k * tl.exp(c_last - c)[:, None]
        s = s * tl.exp(c_last) + tl.dot(tl.trans(k_to_end), d, input_precision=PRECISION)
    tl.store(tile, s, mask=dv_mask[None, :])


def chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    ssm_state: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor, cu_seqlens: torch.Tensor,
                    scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    """The gated delta rule for every sequence of a flat batch, each from its state slot.

    ``q``/``k`` [T, Hk, Dk] raw (after conv and SiLU), ``v`` [T, Hv, Dv] (each with unit stride inside a row),
    ``g``/``beta`` [T, Hv] float32, ``ssm_state`` [slots, Hv, Dk, Dv] float32, updated in place at ``slots``
    [N]; ``keep`` [N] (a sequence that starts fresh has 0: its state starts from zeros); ``cu_seqlens`` [N + 1]
    int32. Returns the outputs [T, Hv, Dv] in ``out_dtype``. float32 queries get IEEE float32 tile products,
    others TF32.
    """
    tokens, key_heads, dk = q.shape
    value_heads, dv = v.shape[1], v.shape[2]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or q.stride(0) != k.stride(0):
        raise ValueError("chunked_prefill needs unit-stride heads and q, k rows of one stride")
    if q.stride(1) != dk or k.stride(1) != dk or v.stride(1) != dv:
        raise ValueError("chunked_prefill needs the heads of a row side by side")
    if g.stride(1) != 1 or beta.stride(1) != 1 or beta.stride(0) != g.stride(0) or not ssm_state.is_contiguous():
        raise ValueError("chunked_prefill needs g and beta rows of one stride and a contiguous state pool")
    if dk != triton.next_power_of_2(dk) or value_heads % key_heads:
        raise ValueError("chunked_prefill needs a power-of-two key dimension and whole key-head groups")
    out = torch.empty(tokens, value_heads, dv, dtype=out_dtype, device=q.device)
    sequences = cu_seqlens.numel() - 1
    if tokens == 0 or sequences == 0:
        return out
    block_v = min(32, triton.next_power_of_2(dv))
    grid = (sequences, value_heads, triton.cdiv(dv, block_v))
    _chunk_rule_kernel[grid](q, k, v, q.stride(0), v.stride(0), g, beta, g.stride(0), ssm_state,
                             ssm_state.stride(0), ssm_state.stride(1), cu_seqlens, slots, keep, out, out.stride(0),
                             out.stride(1), scale, GROUP=value_heads // key_heads, DK=dk, DV=dv, BLOCK_V=block_v,
                             CHUNK_=CHUNK, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                             num_warps=4)
    return out


@triton.jit
def _conv_prefill_kernel(x_ptr, stride_x, w_ptr, conv_ptr, stride_cs, stride_ck, cu_ptr, slot_ptr, keep_ptr, out_ptr,
                         channels, KSIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    t0 = start + tl.program_id(1) * BLOCK_T
    if t0 >= end:
        return
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    rows = t0 + tl.arange(0, BLOCK_T)
    keep = (rows * 0 + tl.load(keep_ptr + seq)) != 0   # (per row: a scalar in a mask fails in the interpreter)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < channels
    valid = rows < end
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KSIZE):
        src = rows - (KSIZE - 1) + j                       # the input this tap reads
        inside = src >= start
        x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                    mask=(valid & inside)[:, None] & c_mask[None, :], other=0.0)
        # before the sequence's first token: the conv state's rows (the last K-1 inputs before it)
        old_row = tl.where(inside, 0, src - start + KSIZE - 1)
        old = tl.load(conv_ptr + slot * stride_cs + old_row[:, None] * stride_ck + cols[None, :],
                      mask=(valid & ~inside & keep)[:, None] & c_mask[None, :], other=0.0)
        tap = tl.load(w_ptr + cols * KSIZE + j, mask=c_mask, other=0.0).to(tl.float32)
        acc += (x.to(tl.float32) + old.to(tl.float32)) * tap[None, :]
    y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)    # the reference rounds the conv output, then the SiLU
    y = y / (1.0 + tl.exp(-y))
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * channels + cols[None, :], y.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & c_mask[None, :])


@triton.jit
def _conv_state_kernel(x_ptr, stride_x, conv_ptr, stride_cs, stride_ck, cu_ptr, slot_ptr, keep_ptr, channels,
                       KSIZE: tl.constexpr, ROWS_PAD: tl.constexpr, BLOCK_C: tl.constexpr):
    """A sequence's new conv state: its window's last ``K - 1`` inputs (old state rows where it is shorter),
    every value read before any is written."""
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq)
    end = tl.load(cu_ptr + seq + 1)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_mask = cols < channels
    p = tl.arange(0, ROWS_PAD)
    keep = (p * 0 + tl.load(keep_ptr + seq)) != 0
    p_mask = p < KSIZE - 1
    src = end - (KSIZE - 1) + p
    inside = src >= start
    x = tl.load(x_ptr + src.to(tl.int64)[:, None] * stride_x + cols[None, :],
                mask=(p_mask & inside)[:, None] & c_mask[None, :], other=0.0)
    old_row = tl.where(inside, 0, src - start + KSIZE - 1)
    state = conv_ptr + slot * stride_cs
    old = tl.load(state + old_row[:, None] * stride_ck + cols[None, :],
                  mask=(p_mask & ~inside & keep)[:, None] & c_mask[None, :], other=0.0)
    tl.debug_barrier()
    tl.store(state + p[:, None] * stride_ck + cols[None, :], (x.to(tl.float32) + old.to(tl.float32)).to(
        conv_ptr.dtype.element_ty), mask=p_mask[:, None] & c_mask[None, :])


def conv_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                 keep: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int) -> torch.Tensor:
    """``silu(causal_conv1d(x))`` of every sequence of a flat batch, from and into its conv-state slot.

    ``x`` [T, C] (unit stride inside a row), ``weight`` [C, K], ``conv_state`` [slots, K - 1, C] updated in place
    at ``slots`` [N]; ``keep`` [N] (0: the sequence starts fresh, from zeros); ``cu_seqlens`` [N + 1] int32;
    ``max_len`` the longest sequence. Returns [T, C] in ``x``'s dtype.
    """
    tokens, channels = x.shape
    ksize = weight.shape[1]
    if x.stride(1) != 1 or not weight.is_contiguous() or conv_state.stride(2) != 1:
        raise ValueError("conv_prefill needs unit-stride rows, a contiguous weight and conv state")
    if ksize < 2:
        raise ValueError("conv_prefill needs a conv kernel of at least 2 taps")
    out = torch.empty(tokens, channels, dtype=x.dtype, device=x.device)
    sequences = cu_seqlens.numel() - 1
    if tokens == 0 or sequences == 0:
        return out
    block_t, block_c = 16, 128
    grid = (sequences, triton.cdiv(max_len, block_t), triton.cdiv(channels, block_c))
    _conv_prefill_kernel[grid](x, x.stride(0), weight, conv_state, conv_state.stride(0), conv_state.stride(1),
                               cu_seqlens, slots, keep, out, channels, KSIZE=ksize, BLOCK_T=block_t, BLOCK_C=block_c,
                               num_warps=4)
    _conv_state_kernel[(sequences, triton.cdiv(channels, block_c))](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), cu_seqlens, slots, keep, channels,
        KSIZE=ksize, ROWS_PAD=triton.next_power_of_2(ksize - 1), BLOCK_C=block_c, num_warps=4)
    return out
