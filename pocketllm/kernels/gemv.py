"""Skinny matrix products (a few rows of activations times a large weight), for decode at small batch.

At one to sixteen rows a linear layer is a pass over its weight: its time is the weight's bytes over memory
bandwidth. cuBLAS's choice for these shapes was measured on an H200 at about 1 TB/s for the 151936 × 1024
LM head of Qwen3-0.6B; this kernel streams the weight in [BLOCK_N, BLOCK_K] tiles, many programs wide.
``skinny_rows_for`` times both on the actual weight and says up to how many rows to use it; for one row,
``best_one_row_config`` picks the kernel's launch settings per weight shape. Prologues (RMSNorm, SiLU·mul of
the input) and, for one row, a SiLU·mul epilogue of a [gate; up] product run inside the same kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pocketllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _input_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, k0, K, stride_xm, stride_rm, rstd, pid, eps,
                PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_OFFSET: tl.constexpr,
                BLOCK_K: tl.constexpr):
    """The [rows, BLOCK_K] tile of the product's input at column ``k0``, after the prologue, in float32
    (values rounded to the input dtype where the unfused reference rounds)."""
    rk = k0 + tl.arange(0, BLOCK_K)
    k_mask = rk < K
    mask = m_mask[:, None] & k_mask[None, :]
    offs = rows[:, None] * stride_xm + rk[None, :]
    if PROLOGUE == 1:  # silu(gate) * up, the input holding [gate | up]
        gate = tl.load(x_ptr + offs, mask=mask, other=0.0)
        up = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        x = (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype).to(tl.float32)
    elif PROLOGUE == 2:  # RMSNorm of (x + residual), the sum written out once by program 0
        h = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            if pid == 0:
                tl.store(res_out_ptr + rows[:, None] * K + rk[None, :], h, mask=mask)
        w = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        if NORM_OFFSET:
            w = w + 1.0
        x = (h.to(tl.float32) * rstd[:, None] * w[None, :]).to(h.dtype).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _inverse_rms(x_ptr, res_ptr, rows, m_mask, K, stride_xm, stride_rm, eps, HAS_RESIDUAL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``1 / rms(x + residual)`` per row (the sum rounded to the input dtype first, as the reference does)."""
    squares = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (rk < K)[None, :]
        h = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_rm + rk[None, :], mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
        hf = h.to(tl.float32)
        squares += hf * hf
    return tl.rsqrt(tl.sum(squares, 1) / K + eps)


@triton.jit
def _store_normed(normed_ptr, x, rows, m_mask, k0, K, pid, BLOCK_K: tl.constexpr):
    """Program 0 writes the normed input tile ``x`` (already rounded to the input dtype) at column ``k0``."""
    if pid == 0:
        rk = k0 + tl.arange(0, BLOCK_K)
        tl.store(normed_ptr + rows[:, None] * K + rk[None, :], x.to(normed_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & (rk < K)[None, :])


@triton.jit(do_not_specialize=["M"])   # the row count changes step to step: one compiled variant for all
def _skinny_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, M, N, K, stride_xm,
                   stride_wn, stride_om, stride_rm, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                   NORM_OFFSET: tl.constexpr, HAS_SCALE: tl.constexpr, NORMED_OUT: tl.constexpr, PDL: tl.constexpr):
    """A few rows times a weight, [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tiles on the tensor cores. With
    ``HAS_SCALE`` the weight is float8 with one scale per output row: tiles widen to the activations' dtype and
    the scales multiply the finished dot products. With ``NORMED_OUT`` (the RMSNorm prologue) program 0 also
    writes the normed input, for a layer that reads it after this product."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    rows = tl.arange(0, BLOCK_M)
    m_mask = rows < M
    w_first = tl.load(w_rows + rk[None, :], mask=n_mask[:, None] & (rk < K)[None, :], other=0.0)
    if PDL:
        # Up to here only the weight was read, which no kernel writes: launched as a programmatic dependent,
        # that overlaps earlier kernels still running. Their output is read only after the wait.
        gdc_wait()
    if PROLOGUE == 2:
        rstd = _inverse_rms(x_ptr, res_ptr, rows, m_mask, K, stride_xm, stride_rm, eps, HAS_RESIDUAL, BLOCK_M,
                            BLOCK_K)
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    x = _input_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, 0, K, stride_xm, stride_rm, rstd, pid, eps,
                    PROLOGUE, HAS_RESIDUAL, NORM_OFFSET, BLOCK_K)
    if NORMED_OUT:
        _store_normed(normed_ptr, x, rows, m_mask, 0, K, pid, BLOCK_K)
    dot_dtype = x_ptr.dtype.element_ty if HAS_SCALE else w_first.dtype
    acc = tl.dot(x.to(dot_dtype), tl.trans(w_first.to(dot_dtype)))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        x = _input_tile(x_ptr, res_ptr, nw_ptr, res_out_ptr, rows, m_mask, k0, K, stride_xm, stride_rm, rstd,
                        pid, eps, PROLOGUE, HAS_RESIDUAL, NORM_OFFSET, BLOCK_K)
        if NORMED_OUT:
            _store_normed(normed_ptr, x, rows, m_mask, k0, K, pid, BLOCK_K)
        w = tl.load(w_rows + (k0 + rk)[None, :], mask=n_mask[:, None] & ((k0 + rk) < K)[None, :], other=0.0)
        acc += tl.dot(x.to(dot_dtype), tl.trans(w.to(dot_dtype)))
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)[None, :]
    tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _one_row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, rk, k_mask, pid, PROLOGUE: tl.constexpr,
                   HAS_RESIDUAL: tl.constexpr, NORM_OFFSET: tl.constexpr, K):
    """(the product's input at columns ``rk``, the squares for the row's RMS) in float32 for one row. With
    the RMSNorm prologue the input is ``h * norm_weight``: the row's ``1 / rms(h)`` is a common factor,
    applied once to the finished dot products, so the row is read in one pass with the weight."""
    if PROLOGUE == 1:  # silu(gate) * up, the input holding [gate | up]
        gate = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
        up = tl.load(x_ptr + K + rk, mask=k_mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        return (g / (1.0 + tl.exp(-g)) * up).to(gate.dtype).to(tl.float32), tl.zeros_like(up)
    elif PROLOGUE == 2:
        h = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rk, mask=k_mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            if pid == 0:
                tl.store(res_out_ptr + rk, h, mask=k_mask)
        w = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        if NORM_OFFSET:
            w = w + 1.0
        hf = h.to(tl.float32)
        return hf * w, hf * hf
    else:
        x = tl.load(x_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
        return x, tl.zeros_like(x)


@triton.jit
def _one_row_normed(x_ptr, res_ptr, nw_ptr, normed_ptr, rstd, K, pid, HAS_RESIDUAL: tl.constexpr,
                    NORM_OFFSET: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program 0 writes ``rms_norm(x + residual)`` of the row, rounded as the RMSNorm kernel rounds."""
    if pid == 0:
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_mask = rk < K
            h = tl.load(x_ptr + rk, mask=k_mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rk, mask=k_mask, other=0.0)
                h = (h.to(tl.float32) + r.to(tl.float32)).to(h.dtype)
            w = tl.load(nw_ptr + rk, mask=k_mask, other=0.0).to(tl.float32)
            if NORM_OFFSET:
                w = w + 1.0
            tl.store(normed_ptr + rk, (h.to(tl.float32) * rstd * w).to(normed_ptr.dtype.element_ty), mask=k_mask)


@triton.jit
def _partial(w, x, REDUCE_EACH: tl.constexpr):
    """A weight tile's products with the input: summed per row at once (``REDUCE_EACH``), or kept whole."""
    prod = w.to(tl.float32) * x[None, :]
    if REDUCE_EACH:  # (a compile-time branch: one return, so the result's shape may differ)
        result = tl.sum(prod, 1)
    else:
        result = prod
    return result


@triton.jit
def _row_sums(acc, REDUCE_EACH: tl.constexpr):
    if REDUCE_EACH:
        result = acc
    else:
        result = tl.sum(acc, 1)
    return result


@triton.jit
def _one_row_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr, normed_ptr, N, K, stride_wn, eps,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, REDUCE_EACH: tl.constexpr,
                    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, NORM_OFFSET: tl.constexpr,
                    SILU_EPILOGUE: tl.constexpr, HAS_SCALE: tl.constexpr, NORMED_OUT: tl.constexpr,
                    PDL: tl.constexpr):
    """One activation row times a weight: each program streams BLOCK_N whole weight rows in [BLOCK_N, BLOCK_K]
    tiles. ``REDUCE_EACH`` sums each tile's products at once (an accumulator of BLOCK_N values, so more
    programs fit on a multiprocessor) instead of once at the end. With ``SILU_EPILOGUE`` the weight is
    [gate; up] (2N rows) and the output ``silu(gate) * up`` (N values): a program streams the matching
    gate and up rows, so the activation needs no launch of its own. With ``HAS_SCALE`` the weight is float8
    with one scale per weight row, applied to the finished dot products. With ``NORMED_OUT`` (the RMSNorm
    prologue) program 0 also writes the normed input once the row's RMS is known."""
    if PDL:   # dependents may launch now: each waits on this kernel before it reads this kernel's output
        gdc_launch_dependents()
    pid = tl.program_id(0)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    tile_mask = n_mask[:, None] & (rk < K)[None, :]
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    w_first = tl.load(w_rows + rk[None, :], mask=tile_mask, other=0.0)
    if SILU_EPILOGUE:
        u_rows = w_rows + N.to(tl.int64) * stride_wn
        u_first = tl.load(u_rows + rk[None, :], mask=tile_mask, other=0.0)
    if PDL:
        # Up to here only the weight was read, which no kernel writes: launched as a programmatic dependent,
        # that overlaps earlier kernels still running. Their output is read only after the wait.
        gdc_wait()
    x, squares = _one_row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, rk, rk < K, pid, PROLOGUE, HAS_RESIDUAL,
                                NORM_OFFSET, K)
    acc = _partial(w_first, x, REDUCE_EACH)
    if SILU_EPILOGUE:
        acc_up = _partial(u_first, x, REDUCE_EACH)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ck = k0 + rk
        x, sq = _one_row_input(x_ptr, res_ptr, nw_ptr, res_out_ptr, ck, ck < K, pid, PROLOGUE, HAS_RESIDUAL,
                               NORM_OFFSET, K)
        if PROLOGUE == 2:
            squares += sq
        k_tile_mask = n_mask[:, None] & (ck < K)[None, :]
        acc += _partial(tl.load(w_rows + ck[None, :], mask=k_tile_mask, other=0.0), x, REDUCE_EACH)
        if SILU_EPILOGUE:
            acc_up += _partial(tl.load(u_rows + ck[None, :], mask=k_tile_mask, other=0.0), x, REDUCE_EACH)
    out = _row_sums(acc, REDUCE_EACH)
    if HAS_SCALE:
        out = out * tl.load(scale_ptr + rn, mask=n_mask, other=0.0)
    if PROLOGUE == 2:
        rstd = tl.rsqrt(tl.sum(squares, 0) / K + eps)
        out = out * rstd
        if NORMED_OUT:
            _one_row_normed(x_ptr, res_ptr, nw_ptr, normed_ptr, rstd, K, pid, HAS_RESIDUAL, NORM_OFFSET, BLOCK_K)
    if SILU_EPILOGUE:
        up = _row_sums(acc_up, REDUCE_EACH)
        if HAS_SCALE:
            up = up * tl.load(scale_ptr + N + rn, mask=n_mask, other=0.0)
        if PROLOGUE == 2:
            up = up * rstd
        # rounded as the unfused path rounds: the product to the output dtype, then the activation
        g = out.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = g / (1.0 + tl.exp(-g)) * up.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rn, out.to(out_ptr.dtype.element_ty), mask=n_mask)


MAX_ROWS = 16


class OneRowConfig(NamedTuple):
    """Launch settings of the one-row kernel."""

    block_n: int
    block_k: int
    reduce_each: bool = True
    num_warps: int = 4
    num_stages: int = 1


def _one_row(block_n: int, block_k: int, reduce_each: bool, num_warps: int, k: int) -> OneRowConfig:
    """A setting with its tile no wider than ``k`` (rounded up to a power of two, at least 128)."""
    return OneRowConfig(block_n, min(block_k, max(128, triton.next_power_of_2(k))), reduce_each, num_warps, 1)


def one_row_candidates(k: int, float8: bool = False) -> list[OneRowConfig]:
    """The settings the model runner times on each weight shape. Swept on an H200 over 172 settings on the
    decode shapes of Qwen3-0.6B and Llama-3-8B, one of these was within 3% of the fastest on nine of the ten
    shapes and within 8% on the tenth: narrow tiles (1-8 weight rows) 1024-2048 columns wide, many programs.
    (4096-column tiles, which leave no weight of a 3072-wide row to read after the ``PDL`` wait, were timed
    on Qwen3-0.6B and Llama-3-8B in the engine and never chosen.) A ``float8`` weight also gets each setting
    with the same bytes a tile: twice the columns, twice the warps."""
    plain = [_one_row(1, 2048, False, 8, k), _one_row(2, 2048, False, 8, k), _one_row(4, 1024, False, 4, k),
             _one_row(8, 1024, True, 4, k), _one_row(8, 2048, True, 4, k)]
    return plain + [_same_bytes_in_float8(c, k) for c in plain] if float8 else plain


def _same_bytes_in_float8(config: OneRowConfig, k: int) -> OneRowConfig:
    """``config`` with tiles of twice the weights (as many bytes of a float8 weight as ``config`` reads of a
    bfloat16 one: twice the columns, or twice the rows where the row is not that wide) and twice the warps."""
    warps = min(16, 2 * config.num_warps)
    if 2 * config.block_k <= max(128, triton.next_power_of_2(k)):
        return _one_row(config.block_n, 2 * config.block_k, config.reduce_each, warps, k)
    return _one_row(2 * config.block_n, config.block_k, config.reduce_each, warps, k)


def fused_candidates(k: int, plain: OneRowConfig, float8: bool = False) -> list[OneRowConfig]:
    """Settings timed for a product with a fused prologue: the plain product's best and the 8-row ones (every
    program recomputes the prologue over its input, which fewer, wider programs do less often). A float8
    weight also gets 16- and 32-row tiles: a program reads its input (row, residual, norm weight: six bytes a
    column) once per tile, against one byte a column for each weight row."""
    wide = [_one_row(16, 2048, True, 16, k), _one_row(32, 1024, True, 16, k)] if float8 else []
    return [plain, *(c for c in one_row_candidates(k, float8) if c.block_n == 8), *wide]


def one_row_config(k: int) -> OneRowConfig:
    """The setting used without timing (a module the model runner did not time)."""
    return _one_row(4, 1024, False, 4, k) if k <= 1024 else _one_row(2, 2048, False, 8, k)


NO_PROLOGUE, SILU_MUL, RMS_NORM = 0, 1, 2


def _launch(x: torch.Tensor, weight: torch.Tensor, prologue: int, residual: torch.Tensor | None = None,
            norm_weight: torch.Tensor | None = None, eps: float = 0.0, norm_offset: bool = False,
            config: OneRowConfig | None = None, silu_epilogue: bool = False, out: torch.Tensor | None = None,
            scale: torch.Tensor | None = None, normed: torch.Tensor | None = None,
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    m = x.shape[0]
    n, k = weight.shape
    if not 0 < m <= MAX_ROWS or weight.stride(1) != 1:
        raise ValueError(f"skinny product needs 1..{MAX_ROWS} rows and a row-major weight")
    if (scale is None) == (weight.dtype == torch.float8_e4m3fn) or (scale is not None and scale.shape != (n,)):
        raise ValueError("a float8 weight needs its per-row scales (float32, one per weight row), and only it")
    if silu_epilogue and (m != 1 or n % 2):
        raise ValueError("the SiLU·mul epilogue needs one row and a [gate; up] weight")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_out = n // 2 if silu_epilogue else n
    if out is None:
        out = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n_out) or out.stride(1) != 1:
        raise ValueError(f"output buffer of shape {tuple(out.shape)} for a [{m}, {n_out}] product")
    res_out = None
    if residual is not None:
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        res_out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    pdl, launch = launch_options(x, m)
    res_arg = x if residual is None else residual
    nw_arg = x if norm_weight is None else norm_weight
    res_out_arg = out if res_out is None else res_out
    scale_arg = out if scale is None else scale
    if normed is not None and (prologue != RMS_NORM or normed.shape != (m, k) or not normed.is_contiguous()):
        raise ValueError("the normed input is written by a product with the RMSNorm prologue, into [rows, K]")
    normed_arg = out if normed is None else normed
    if m == 1:
        c = config or one_row_config(k)
        _one_row_kernel[(triton.cdiv(n_out, c.block_n),)](
            x, weight, scale_arg, out, res_arg, nw_arg, res_out_arg, normed_arg, n_out, k, weight.stride(0), eps,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, REDUCE_EACH=c.reduce_each, PROLOGUE=prologue,
            HAS_RESIDUAL=residual is not None, NORM_OFFSET=norm_offset, SILU_EPILOGUE=silu_epilogue,
            HAS_SCALE=scale is not None, NORMED_OUT=normed is not None, PDL=pdl, num_warps=c.num_warps,
            num_stages=c.num_stages, **launch)
        return out, res_out
    _skinny_kernel[(triton.cdiv(n, 64),)](
        x, weight, scale_arg, out, res_arg, nw_arg, res_out_arg, normed_arg, m, n, k, x.stride(0), weight.stride(0),
        out.stride(0), 0 if residual is None else residual.stride(0), eps,
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PROLOGUE=prologue, HAS_RESIDUAL=residual is not None,
        NORM_OFFSET=norm_offset, HAS_SCALE=scale is not None, NORMED_OUT=normed is not None, PDL=pdl,
        num_warps=4, num_stages=4, **launch)
    return out, res_out


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config: OneRowConfig | None = None,
                  out: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [M ≤ 16, K] and ``weight`` [N, K] (row-major), bf16/fp16 (fp32 accumulate),
    written into ``out`` if given. A float8 weight comes with ``scale`` [N] (float32): ``x @ (weight *
    scale[:, None]).T``. Every function below takes ``scale`` the same way."""
    return _launch(x, weight, NO_PROLOGUE, config=config, out=out, scale=scale)[0]


def skinny_silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor, config: OneRowConfig | None = None,
                           scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(silu(gate) * up) @ weight.T`` for ``gate_up`` [M ≤ 16, 2K] holding [gate | up]: the activation is
    computed while loading the product's input, so it costs no launch of its own."""
    return _launch(gate_up, weight, SILU_MUL, config=config, scale=scale)[0]


def skinny_rms_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                           weight: torch.Tensor, norm_offset: bool = False, config: OneRowConfig | None = None,
                           out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
                           normed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual) @ weight.T, x + residual)`` in one launch (without ``residual``: of ``x``,
    which is then returned as the residual). Each program recomputes the row's RMS; program 0 writes the sum,
    and ``rms_norm(x + residual)`` into ``normed`` ([rows, K], contiguous) when given.
    One row is read in a single pass (``1 / rms`` applied to the dot products); more rows in two.
    ``norm_offset`` scales by ``1 + norm_weight`` (the zero-centred norms of Qwen3.5 and Gemma)."""
    out, summed = _launch(x, weight, RMS_NORM, residual, norm_weight, eps, norm_offset, config, out=out, scale=scale,
                          normed=normed)
    return out, x if summed is None else summed


def one_row_silu_product(x: torch.Tensor, weight: torch.Tensor, config: OneRowConfig | None = None,
                         residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                         eps: float = 0.0, norm_offset: bool = False, scale: torch.Tensor | None = None,
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``silu(gate) * up`` of ``x @ weight.T`` for one row ``x`` [1, K] and ``weight`` [gate; up] [2N, K], in
    one launch: (activation [1, N], None). With ``norm_weight`` the input is first RMS-normed (of ``x +
    residual``), as ``skinny_rms_norm_linear`` does, and the second value is ``x + residual`` (or ``x``)."""
    if norm_weight is None:
        return _launch(x, weight, NO_PROLOGUE, config=config, silu_epilogue=True, scale=scale)[0], None
    out, summed = _launch(x, weight, RMS_NORM, residual, norm_weight, eps, norm_offset, config, silu_epilogue=True,
                          scale=scale)
    return out, x if summed is None else summed


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


def _rotating(weight: torch.Tensor):
    """A function returning the weight or one of 7 random copies in turn (for weights under 64 MB), so that
    small weights are not timed out of L2 when in a model every layer brings its own weight."""
    copies = [weight]
    if weight.numel() * weight.element_size() < (64 << 20):
        copies += [torch.randn(weight.shape, device=weight.device).to(weight.dtype) for _ in range(7)]
    turn = [0]

    def next_weight() -> torch.Tensor:
        turn[0] += 1
        return copies[turn[0] % len(copies)]

    return next_weight


SKINNY_WEIGHT_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)


def _times_skinny(weight: torch.Tensor) -> bool:
    return weight.dtype in SKINNY_WEIGHT_DTYPES and weight.dim() == 2 and weight.stride(1) == 1


def _activation_dtype(weight: torch.Tensor) -> torch.dtype:
    """The activations' dtype for timing a product with ``weight`` (bfloat16 for a float8 weight)."""
    return torch.bfloat16 if weight.dtype == torch.float8_e4m3fn else weight.dtype


def _library_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The product a layer runs where the skinny kernel does not: cuBLAS (a float8 weight: ``fp8``'s)."""
    if scale is None:
        return torch.nn.functional.linear(x, weight)
    from pocketllm.kernels.fp8 import scaled_product

    return scaled_product(x, weight, scale)


def best_one_row_config(weight: torch.Tensor, prologue: int = NO_PROLOGUE,
                        candidates: list[OneRowConfig] | None = None,
                        scale: torch.Tensor | None = None) -> OneRowConfig:
    """The fastest of ``candidates`` (default: ``one_row_candidates``) for one row times this weight (float8:
    with its ``scale``), with ``prologue`` fused, timed on the weight and copies of it in turn."""
    k = weight.shape[1]
    candidates = candidates or one_row_candidates(k, weight.dtype == torch.float8_e4m3fn)
    next_weight = _rotating(weight)
    dtype = _activation_dtype(weight)
    x = torch.randn(1, 2 * k if prologue == SILU_MUL else k, dtype=dtype, device=weight.device)
    residual = torch.randn(1, k, dtype=dtype, device=weight.device)
    norm_weight = torch.rand(k, dtype=dtype, device=weight.device) + 0.5
    times = {}
    for config in dict.fromkeys(candidates):
        if prologue == SILU_MUL:
            times[config] = time_in_graph(lambda c=config: skinny_silu_mul_linear(x, next_weight(), c, scale))
        elif prologue == RMS_NORM:
            times[config] = time_in_graph(lambda c=config: skinny_rms_norm_linear(
                x, residual, norm_weight, 1e-6, next_weight(), config=c, scale=scale))
        else:
            times[config] = time_in_graph(lambda c=config: skinny_linear(x, next_weight(), c, scale=scale))
    return min(times, key=times.get)


def skinny_rows_for(weight: torch.Tensor, config: OneRowConfig | None = None,
                    scale: torch.Tensor | None = None) -> int:
    """Most rows (1, 2, 4, 8 or 16; 0 = none) up to which the skinny kernel (one row: with ``config``) beats
    the library's product by 5% on this weight's shape, timed on the weight (and copies of it in turn)."""
    if not _times_skinny(weight):
        return 0
    next_weight = _rotating(weight)
    rows = 0
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, weight.shape[1], dtype=_activation_dtype(weight), device=weight.device)
        ours = time_in_graph(lambda x=x: skinny_linear(x, next_weight(), config, scale=scale))
        theirs = time_in_graph(lambda x=x: _library_product(x, next_weight(), scale))
        if ours >= 0.95 * theirs:
            break
        rows = m
    return rows


def fused_rows_for(weight: torch.Tensor, prologue: int, plain_rows: int, plain: OneRowConfig | None = None,
                   fused: OneRowConfig | None = None, scale: torch.Tensor | None = None) -> int:
    """Most rows up to which the product with its prologue (``SILU_MUL`` or ``RMS_NORM``) fused in one launch
    (one row: with setting ``fused``) beats the prologue's own kernel followed by the product the layer would
    otherwise run (skinny up to ``plain_rows`` rows, with setting ``plain`` for one row; cuBLAS beyond)."""
    if not _times_skinny(weight):
        return 0
    from pocketllm.kernels.fused import rms_norm, silu_and_mul

    next_weight = _rotating(weight)
    k = weight.shape[1]
    dtype = _activation_dtype(weight)
    norm_weight = torch.rand(k, dtype=dtype, device=weight.device) + 0.5

    def product(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= plain_rows:
            return skinny_linear(x, next_weight(), plain, scale=scale)
        return _library_product(x, next_weight(), scale)

    rows = 0
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, 2 * k if prologue == SILU_MUL else k, dtype=dtype, device=weight.device)
        residual = torch.randn(m, k, dtype=dtype, device=weight.device)
        if prologue == SILU_MUL:
            ours = time_in_graph(lambda x=x: skinny_silu_mul_linear(x, next_weight(), fused, scale))
            theirs = time_in_graph(lambda x=x: product(silu_and_mul(x)))
        else:
            ours = time_in_graph(lambda x=x, r=residual: skinny_rms_norm_linear(
                x, r, norm_weight, 1e-6, next_weight(), config=fused, scale=scale))
            theirs = time_in_graph(lambda x=x, r=residual: product(rms_norm(x, norm_weight, 1e-6, r)[0]))
        if ours >= theirs:
            break
        rows = m
    return rows


def silu_epilogue_candidates(k: int, float8: bool = False) -> list[OneRowConfig]:
    """Settings timed for the product with the SiLU·mul epilogue: 2-8 weight rows a program (each program
    streams twice that, gate and up)."""
    plain = one_row_candidates(k)[1:4]
    wide = [_one_row(8, 2048, True, 8, k), _one_row(16, 1024, True, 16, k)]
    return plain + [_same_bytes_in_float8(c, k) for c in plain] + wide if float8 else plain


def silu_epilogue_choice(weight: torch.Tensor, norm: bool, plain: OneRowConfig | None, plain_rows: int,
                         fused: OneRowConfig | None, fused_rows: int,
                         scale: torch.Tensor | None = None) -> tuple[OneRowConfig | None, bool]:
    """For one row times the [gate; up] ``weight``: the launch settings of the product with its SiLU·mul
    epilogue, and whether the RMSNorm before it (``norm``: the layer has one) runs in that kernel too; or
    (None, False) when the path the layer runs otherwise is faster: the product as chosen (skinny with
    ``plain`` up to ``plain_rows`` rows, the norm fused with ``fused`` up to ``fused_rows``), then the
    activation's own kernel."""
    from pocketllm.kernels.fused import rms_norm, silu_and_mul

    next_weight = _rotating(weight)
    k = weight.shape[1]
    dtype = _activation_dtype(weight)
    x, residual = torch.randn(2, 1, k, dtype=dtype, device=weight.device)
    norm_weight = torch.rand(k, dtype=dtype, device=weight.device) + 0.5

    def normed() -> torch.Tensor:
        return rms_norm(x, norm_weight, 1e-6, residual)[0] if norm else x

    def baseline() -> torch.Tensor:
        if norm and fused_rows >= 1:
            return silu_and_mul(skinny_rms_norm_linear(x, residual, norm_weight, 1e-6, next_weight(), config=fused,
                                                       scale=scale)[0])
        h = normed()
        return silu_and_mul(skinny_linear(h, next_weight(), plain, scale=scale) if plain_rows >= 1
                            else _library_product(h, next_weight(), scale))

    best: tuple[float, OneRowConfig | None, bool] = (time_in_graph(baseline), None, False)
    for config in silu_epilogue_candidates(k, weight.dtype == torch.float8_e4m3fn):
        options = [(False, lambda c=config: one_row_silu_product(normed(), next_weight(), c, scale=scale))]
        if norm:
            options.append((True, lambda c=config: one_row_silu_product(x, next_weight(), c, residual, norm_weight,
                                                                        1e-6, scale=scale)))
        for fused_norm, fn in options:
            t = time_in_graph(fn)
            if t < best[0]:
                best = (t, config, fused_norm)
    return best[1], best[2]

