"""The Gated DeltaNet decode step in two launches (the PyTorch reference is ``pocketllm.layers.gated_delta``).

Launch 1, one program per (row, head of q, k or v): the causal conv1d update of that head's channels from the
row's conv-state slot (the shifted window is written back), SiLU, and for q and k the L2 normalisation (q also
scaled by ``key_dim ** -0.5``); results go to a float32 scratch row [conv_dim]. Launch 2, one program per
(row, value head, value block): the gate and beta from ``a``/``b``, the gated delta-rule update of the float32
state tile [key_dim, block] in place, ``o = S^T q``, and when the block is the whole head the gated RMSNorm of
``o`` times ``silu(z)``. Value head ``h`` reads key head ``h // (value_heads / key_heads)``.

Two launches because a key head's conv channels are shared by every value head of its group: the conv state
must be read by all of them before any writes it back, and a grid has no barrier. Rows whose context length
is at most 1 (a one-token prompt, or a CUDA-graph padding row with length 0) start from zero conv and ssm
state. Nothing reads the host: the step can be captured in a CUDA graph.

Chains (``chain``): consecutive rows may be consecutive positions of one sequence (a speculative verify chunk run
as decode rows). ``chain[r]`` is the slot row ``r`` reads its states from when it starts a chain, or -1 when it
continues the row before it; ``slots[r]`` is where the states after row ``r`` go (a verify chunk's checkpoint
slots, then the sequence's own). The program of a chain's first row runs the chain's rows in order, keeping the
state in registers between them; the programs of the other rows return at once.

Physical bound (Qwen3.5-9B shapes: 32 value heads, Dk = Dv = 128, hidden 4096, bf16 weights): the state is
read and written once per step, 2 * 32 * 128 * 128 * 4 B = 4 MiB per sequence per layer, while the layer's
weights (in_proj 12352 x 4096 and out_proj 4096 x 4096, bf16) are about 135 MB, read once per step whatever
the batch. So at batch 1 the state is ~3% of the layer's bytes and the step is bound by the weights and by
launch latency; from batch ~32 on the state traffic (B * 4 MiB) overtakes the weights and sets the time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_row(x_ptr, stride_x, w_row, conv_ptr, stride_cs, stride_ck, out_ptr, row, source, target, keep, cols, mask,
              conv_dim, is_q, is_qk, q_scale, KSIZE: tl.constexpr):
    """Row ``row``'s conv update: window from slot ``source`` (zeros unless ``keep``), new window to ``target``."""
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    old = conv_ptr + source * stride_cs + cols
    new = conv_ptr + target * stride_cs + cols
    # The window is [old_0 .. old_{K-2}, x]; the new state is [old_1 .. old_{K-2}, x]. Each old row is loaded
    # before the store that may overwrite it (same program, same layout).
    cur = tl.load(old, mask=mask, other=0.0)
    cur = tl.where(keep, cur, 0.0).to(x.dtype)
    acc = cur.to(tl.float32) * tl.load(w_row, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, KSIZE - 1):
        nxt = tl.load(old + j * stride_ck, mask=mask, other=0.0)
        nxt = tl.where(keep, nxt, 0.0).to(x.dtype)
        tl.store(new + (j - 1) * stride_ck, nxt.to(conv_ptr.dtype.element_ty), mask=mask)
        acc += nxt.to(tl.float32) * tl.load(w_row + j, mask=mask, other=0.0).to(tl.float32)
    tl.store(new + (KSIZE - 2) * stride_ck, x.to(conv_ptr.dtype.element_ty), mask=mask)
    acc += x.to(tl.float32) * tl.load(w_row + (KSIZE - 1), mask=mask, other=0.0).to(tl.float32)
    # the reference rounds the conv output and the SiLU output to the model dtype
    y = acc.to(x.dtype).to(tl.float32)
    y = (y / (1.0 + tl.exp(-y))).to(x.dtype).to(tl.float32)
    if is_qk:
        y = y * tl.rsqrt(tl.sum(y * y, 0) + 1e-6)
        y = tl.where(is_q, y * q_scale, y)
    tl.store(out_ptr + row * conv_dim + cols, y, mask=mask)


@triton.jit
def _conv_step_kernel(x_ptr, stride_x, w_ptr, conv_ptr, stride_cs, stride_ck, slot_ptr, chain_ptr, ctx_ptr, out_ptr,
                      rows, conv_dim, key_heads, dk, dv, q_scale, KSIZE: tl.constexpr, BLOCK: tl.constexpr,
                      CHAINED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    is_v = part >= 2 * key_heads
    is_qk = part < 2 * key_heads
    is_q = part < key_heads
    start = tl.where(is_v, 2 * key_heads * dk + (part - 2 * key_heads) * dv, part * dk)
    width = tl.where(is_v, dv, dk)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    cols = start + offs
    w_row = w_ptr + cols * KSIZE
    keep = tl.load(ctx_ptr + row) > 1
    target = tl.load(slot_ptr + row).to(tl.int64)
    if CHAINED:
        source = tl.load(chain_ptr + row).to(tl.int64)
        go = source >= 0
        while go:
            _conv_row(x_ptr, stride_x, w_row, conv_ptr, stride_cs, stride_ck, out_ptr, row, source, target, keep,
                      cols, mask, conv_dim, is_q, is_qk, q_scale, KSIZE)
            tl.debug_barrier()   # the next row of the chain reads the window just written
            row += 1
            go = tl.load(chain_ptr + row, mask=row < rows, other=0) < 0
            source = target
            target = tl.load(slot_ptr + row, mask=go, other=0).to(tl.int64)
            keep = source >= 0
    else:
        _conv_row(x_ptr, stride_x, w_row, conv_ptr, stride_cs, stride_ck, out_ptr, row, target, target, keep, cols,
                  mask, conv_dim, is_q, is_qk, q_scale, KSIZE)


@triton.jit
def _softplus(x):
    """``log(1 + e^x)`` as torch's softplus (threshold 20); log1p by Kahan's trick (no log1p in tl)."""
    e = tl.exp(x)
    w = 1.0 + e
    lp = tl.where(w == 1.0, e, tl.log(w) * e / (w - 1.0))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def _delta_row(s, qkv_ptr, a_ptr, b_ptr, stride_ab, a_log, dt_bias, z_ptr, stride_z, norm_w_ptr, out_ptr, stride_o,
               eps, row, h, kh, kk, vv, k_mask, v_mask, conv_dim, key_heads, DK: tl.constexpr, DV: tl.constexpr,
               FUSE_NORM: tl.constexpr, ROUND_PRODUCT: tl.constexpr):
    """Row ``row``'s delta-rule update of the state tile ``s`` and its output (normalised and gated when
    ``FUSE_NORM``); returns the new tile."""
    src = qkv_ptr + row * conv_dim
    q = tl.load(src + kh * DK + kk, mask=k_mask, other=0.0)
    k = tl.load(src + key_heads * DK + kh * DK + kk, mask=k_mask, other=0.0)
    v = tl.load(src + 2 * key_heads * DK + h * DV + vv, mask=v_mask, other=0.0)
    a = tl.load(a_ptr + row * stride_ab + h).to(tl.float32)
    b = tl.load(b_ptr + row * stride_ab + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-b))
    g = -tl.exp(a_log) * _softplus(a + dt_bias)
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], 0)
    delta = beta * (v - predicted)
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0)

    dst = out_ptr + row * stride_o + h * DV + vv
    if FUSE_NORM:
        # GatedRMSNorm with the reference's rounding points: the rule's output, the normalised value and
        # (when the weight is in the model dtype) the weighted value are rounded to the model dtype.
        x = o.to(out_ptr.dtype.element_ty).to(tl.float32)
        x = tl.where(v_mask, x, 0.0)
        normed = (x * tl.rsqrt(tl.sum(x * x, 0) / DV + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
        normed = normed * tl.load(norm_w_ptr + vv, mask=v_mask, other=0.0).to(tl.float32)
        if ROUND_PRODUCT:
            normed = normed.to(out_ptr.dtype.element_ty).to(tl.float32)
        z = tl.load(z_ptr + row * stride_z + h * DV + vv, mask=v_mask, other=0.0).to(tl.float32)
        tl.store(dst, (normed * (z / (1.0 + tl.exp(-z)))).to(out_ptr.dtype.element_ty), mask=v_mask)
    else:
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=v_mask)
    return s


@triton.jit
def _delta_rule_kernel(qkv_ptr, a_ptr, b_ptr, stride_ab, a_log_ptr, dt_bias_ptr, ssm_ptr, stride_ss, stride_sh,
                       slot_ptr, chain_ptr, ctx_ptr, z_ptr, stride_z, norm_w_ptr, out_ptr, stride_o, eps,
                       rows, conv_dim, key_heads, groups,
                       DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                       FUSE_NORM: tl.constexpr, ROUND_PRODUCT: tl.constexpr, CHAINED: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    kh = h // groups
    kk = tl.arange(0, BK)
    vv = vb * BV + tl.arange(0, BV)
    k_mask = kk < DK
    v_mask = vv < DV
    tile_mask = k_mask[:, None] & v_mask[None, :]
    tile = ssm_ptr + h * stride_sh + kk[:, None] * DV + vv[None, :]
    keep = tl.load(ctx_ptr + row) > 1
    a_log = tl.load(a_log_ptr + h).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    target = tl.load(slot_ptr + row).to(tl.int64)
    if CHAINED:
        source = tl.load(chain_ptr + row).to(tl.int64)
        if source >= 0:   # (a row that continues a chain is run by the chain's first row)
            s = tl.load(tile + source * stride_ss, mask=tile_mask, other=0.0)
            s = tl.where(keep, s, 0.0)
            go = source >= 0
            while go:
                s = _delta_row(s, qkv_ptr, a_ptr, b_ptr, stride_ab, a_log, dt_bias, z_ptr, stride_z, norm_w_ptr,
                               out_ptr, stride_o, eps, row, h, kh, kk, vv, k_mask, v_mask, conv_dim, key_heads, DK,
                               DV, FUSE_NORM, ROUND_PRODUCT)
                tl.store(tile + target * stride_ss, s, mask=tile_mask)
                row += 1   # the next row continues this chain from the state held here
                go = tl.load(chain_ptr + row, mask=row < rows, other=0) < 0
                target = tl.load(slot_ptr + row, mask=go, other=0).to(tl.int64)
    else:
        s = tl.load(tile + target * stride_ss, mask=tile_mask, other=0.0)
        s = tl.where(keep, s, 0.0)
        s = _delta_row(s, qkv_ptr, a_ptr, b_ptr, stride_ab, a_log, dt_bias, z_ptr, stride_z, norm_w_ptr, out_ptr,
                       stride_o, eps, row, h, kh, kk, vv, k_mask, v_mask, conv_dim, key_heads, DK, DV, FUSE_NORM,
                       ROUND_PRODUCT)
        tl.store(tile + target * stride_ss, s, mask=tile_mask)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def gated_delta_decode(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
                       a_log: torch.Tensor, dt_bias: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                       slots: torch.Tensor, context_lens: torch.Tensor, num_k_heads: int, num_v_heads: int,
                       head_k_dim: int, head_v_dim: int, z: torch.Tensor | None = None,
                       norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                       block_v: int | None = None, num_warps: int | None = None,
                       chain: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token per row: ``mixed`` [B, conv_dim] (pre-conv q|k|v), ``a``/``b`` [B, Hv] (row-strided
    views are fine), states updated in place at ``slots`` [B]; ``context_lens`` [B] (<= 1: fresh row).
    ``chain`` [B] (optional): rows as chains of one sequence's positions (the module docstring); the states
    after each row go to its slot in ``slots``.

    Returns [B, Hv * Dv] in ``mixed``'s dtype: ``norm(o) * silu(z)`` when ``z`` and ``norm_weight`` are given and
    ``block_v`` covers the whole head (the default), else the rule's output ``o`` (normalise it yourself).
    """
    rows, conv_dim = mixed.shape
    ksize = conv_weight.shape[1]
    if ksize < 2 or conv_state.shape[1] != ksize - 1 or conv_state.shape[2] != conv_dim:
        raise ValueError(f"conv state {tuple(conv_state.shape)} does not fit kernel size {ksize}, {conv_dim} channels")
    if ssm_state.stride(3) != 1 or ssm_state.stride(2) != head_v_dim or conv_state.stride(2) != 1:
        raise ValueError("state pools must be contiguous in their last dimensions")
    if mixed.stride(1) != 1 or conv_weight.stride(0) != ksize or conv_weight.stride(1) != 1:
        raise ValueError("mixed rows and the conv weight must be contiguous")
    block_v = head_v_dim if block_v is None else min(block_v, _pow2(head_v_dim))
    fuse_norm = z is not None and norm_weight is not None and block_v >= head_v_dim
    out = torch.empty(rows, num_v_heads * head_v_dim, dtype=mixed.dtype, device=mixed.device)
    if rows == 0:
        return out
    qkv = torch.empty(rows, conv_dim, dtype=torch.float32, device=mixed.device)
    chained = chain is not None
    chain_arg = chain if chained else slots
    _conv_step_kernel[(rows, 2 * num_k_heads + num_v_heads)](
        mixed, mixed.stride(0), conv_weight, conv_state, conv_state.stride(0), conv_state.stride(1), slots,
        chain_arg, context_lens, qkv, rows, conv_dim, num_k_heads, head_k_dim, head_v_dim, head_k_dim ** -0.5,
        KSIZE=ksize, BLOCK=_pow2(max(head_k_dim, head_v_dim)), CHAINED=chained,
        num_warps=1 if max(head_k_dim, head_v_dim) <= 256 else 4)
    bk, bv = _pow2(head_k_dim), _pow2(block_v)
    if num_warps is None:
        num_warps = 8 if bk * bv >= 128 * 128 else 4 if bk * bv >= 128 * 32 else 1
    if fuse_norm:
        z_arg, stride_z, w_arg = z, z.stride(0), norm_weight
        if z.stride(-1) != 1:
            raise ValueError("z rows must be contiguous")
        round_product = torch.promote_types(norm_weight.dtype, mixed.dtype) == mixed.dtype
    else:
        z_arg, stride_z, w_arg, round_product = qkv, 0, qkv, False
    if a.stride(0) != b.stride(0) or a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("a and b must share a row stride, contiguous within a row")
    _delta_rule_kernel[(rows, num_v_heads, triton.cdiv(head_v_dim, bv))](
        qkv, a, b, a.stride(0), a_log, dt_bias, ssm_state, ssm_state.stride(0), ssm_state.stride(1), slots,
        chain_arg, context_lens, z_arg, stride_z, w_arg, out, out.stride(0), eps, rows, conv_dim, num_k_heads,
        num_v_heads // num_k_heads, DK=head_k_dim, DV=head_v_dim, BK=bk, BV=bv, FUSE_NORM=fuse_norm,
        ROUND_PRODUCT=round_product, CHAINED=chained, num_warps=num_warps)
    return out
