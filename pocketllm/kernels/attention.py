"""Paged-attention kernels: KV-cache store, split-KV decode, and varlen prefill over a cached prefix.

The cache layout is the reference path's: ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer,
so a token's key for KV head ``g`` lives at ``slot * num_kv_heads * head_dim + g * head_dim`` with
``slot = block_table[token // block_size] * block_size + token % block_size``. Kernels gather tokens
through the block table one tile (``BLOCK_N`` tokens, several pages) at a time, so any block size works.

Decode packs the ``G = num_heads / num_kv_heads`` query heads sharing a KV head into the rows of one
tile, so every key and value is read once per sequence; a sequence's context is split into ``num_splits``
pieces handled by separate programs; the last of them to finish (an atomic counter per sequence and KV
head) merges the pieces with log-sum-exp weights in the same launch. The number of splits depends on the
batch size and on a power-of-two bucket of the step's longest context (``decode_splits``), so a CUDA graph
captured per batch size and split count has a fixed launch shape.

A layer with a sliding window passes ``window`` > 0 (0: full attention): the query at position ``p`` attends
the keys at positions ``p - window + 1 .. p`` only (decode starts each split there; prefill masks per row).

Index arithmetic that can exceed 2**31 (slot times row stride) is done in int64. Padding rows of a
CUDA-graph batch carry ``slot = -1`` (nothing stored) and ``context_len = 0`` (zeros out).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from pocketllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


def _pow2(n: int) -> int:
    return triton.next_power_of_2(int(n))


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 models are the exactness oracle: no tf32 in their dot products.
    return "ieee" if dtype == torch.float32 else "tf32"


# ------------------------------------------------------------------------------------------------ store

@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)
    mask = (offs < ROW) & ((offs * 0 + slot) >= 0)   # (a scalar in a mask fails in Triton's interpreter)
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    # (through float32: a float8 cache takes a saturating conversion from it)
    tl.store(k_cache_ptr + slot * ROW + offs, k.to(tl.float32).to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * ROW + offs, v.to(tl.float32).to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write ``k``/``v`` ([T, KVH, D], each token's heads contiguous) to their slots; slot -1 is skipped."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    row = k.shape[1] * k.shape[2]
    k2, v2 = k.reshape(tokens, row), v.reshape(tokens, row)
    assert k2.stride(1) == 1 and v2.stride(1) == 1
    _store_kv_kernel[(tokens,)](k2, v2, k_cache, v_cache, slot_mapping, k2.stride(0), v2.stride(0),
                                ROW=row, ROW_PAD=_pow2(row), num_warps=4 if row >= 1024 else 1)


# ------------------------------------------------------------------------------------------------ decode

@triton.jit
def _program_ids(HEADS_FIRST: tl.constexpr):
    """(sequence, KV head, split) of a decode program. With ``HEADS_FIRST`` the KV heads of one sequence run
    side by side (their rows share DRAM pages)."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.program_id(0), tl.program_id(2)
    else:
        return tl.program_id(0), tl.program_id(1), tl.program_id(2)


@triton.jit
def _split_range(lens_ptr, seq, split, num_splits, BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr):
    """(context length, first token, end token, active splits) of a decode program's split. Splits are whole
    KV tiles of at least ``SPLIT_MIN`` tokens, so a short context fills fewer than ``num_splits``: the others
    have nothing to do and the merge counts only the active ones (at least one, which writes zeros for an
    empty context)."""
    ctx = tl.load(lens_ptr + seq)
    per_split = tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, SPLIT_MIN)
    active = tl.maximum(tl.cdiv(ctx, per_split), 1)
    start = split * per_split
    return ctx, start, tl.minimum(start + per_split, ctx), active


@triton.jit
def _window_start(start, ctx, window):
    """A decode split's first token under a sliding window (``window`` 0: ``start``): the query at ``ctx - 1``
    attends the keys from ``ctx - window`` on."""
    return tl.maximum(start, tl.where(window > 0, ctx - window, 0))


@triton.jit
def _decode_program(lens_ptr, num_splits, window, BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr,
                    HEADS_FIRST: tl.constexpr, PDL: tl.constexpr):
    """A decode program's opening: its dependents may launch (``PDL``; each waits on this kernel before it reads
    this kernel's output); then (sequence, KV head, split, context length, first token under the window, end
    token, active splits). A split wholly before the window is empty (its lse -inf)."""
    if PDL:
        gdc_launch_dependents()
    seq, kvh, split = _program_ids(HEADS_FIRST)
    ctx, start, end, active = _split_range(lens_ptr, seq, split, num_splits, BLOCK_N, SPLIT_MIN)
    return seq, kvh, split, ctx, _window_start(start, ctx, window), end, active


@triton.jit
def _kv_slots(table, tok, end, BLOCK_SIZE: tl.constexpr):
    """(which of tokens ``tok`` lie before ``end``, their cache slots through the block table)."""
    valid = tok < end
    page = tl.load(table + tok // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return valid, page * BLOCK_SIZE + tok % BLOCK_SIZE


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, dims, dim_mask, NUM_KV_HEADS: tl.constexpr,
             HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Keys and values of tokens ``tok`` (those before ``end``) of one KV head, gathered through the block
    table, in the cache's dtype."""
    valid, slot = _kv_slots(table, tok, end, BLOCK_SIZE)
    offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + dims[None, :]
    kv_mask = valid[:, None] & dim_mask[None, :]
    return tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0), tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)


@triton.jit
def _widen_e4m3(code):
    """float8 e4m3 codes (the low byte of an unsigned 16-bit integer) as float16: the sign moves to bit 15 and
    exponent and mantissa to bits 7-13, a float16 256 times smaller (exact for every finite code, small ones as
    float16 subnormals), which one multiply scales back."""
    return (((code & 0x80) << 8) | ((code & 0x7F) << 7)).to(tl.float16, bitcast=True) * 256.0


@triton.jit
def _kv_pairs_fp8(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """A float8 cache's keys and values of tokens ``tok`` as float16, each split into its even and odd
    dimensions: (keys even, keys odd, values even, values odd), [tokens, HEAD_DIM / 2] each. The codes are read in
    pairs (16 bits) and widened by integer operations where they were loaded, so the tiles reach the dot
    products as 16-bit values with no interleaving; a float8 ``.to`` is instead deferred by the compiler to the
    dot's operand layout, where its byte-wise shared-memory reads cost more than the DRAM reads."""
    valid, slot = _kv_slots(table, tok, end, BLOCK_SIZE)
    pairs = tl.arange(0, HEAD_DIM // 2)
    offs = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM // 2) + kvh * (HEAD_DIM // 2) + pairs[None, :]
    k = tl.load(k_cache_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=valid[:, None], other=0)
    v = tl.load(v_cache_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=valid[:, None], other=0)
    return _widen_e4m3(k & 0xFF), _widen_e4m3(k >> 8), _widen_e4m3(v & 0xFF), _widen_e4m3(v >> 8)


@triton.jit
def _attend_pairs(q_even, q_odd, k_even, k_odd, v_even, v_odd, valid, m_i, l_i, acc_even, acc_odd):
    """``_attend_tile`` over a tile split into even and odd dimensions (float16 operands): the scores sum the
    two halves' dot products, and each half of the accumulator takes its own."""
    s = tl.dot(q_even, tl.trans(k_even)) + tl.dot(q_odd, tl.trans(k_odd))
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p16 = p.to(tl.float16)
    acc_even = acc_even * alpha[:, None] + tl.dot(p16, v_even)
    acc_odd = acc_odd * alpha[:, None] + tl.dot(p16, v_odd)
    return m_new, l_i, acc_even, acc_odd


@triton.jit
def _decode_fp8_pairs(q_ptr, k_cache_ptr, v_cache_ptr, table, seq, kvh, ctx, start, end, heads, row_mask,
                      stride_qt, qk_scale, NUM_KV_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """The decode kernel's attention over a float8 cache read by ``_kv_pairs_fp8``: (running max, running sum,
    accumulator [GROUP_PAD, HEAD_DIM]) of the split, the first tile read before the ``PDL`` wait."""
    half = tl.arange(0, HEAD_DIM // 2)
    tok = start + tl.arange(0, BLOCK_N)
    k_even, k_odd, v_even, v_odd = _kv_pairs_fp8(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, NUM_KV_HEADS,
                                                 HEAD_DIM, BLOCK_SIZE)
    if PDL:   # the new token's row, stored by the kernel just before, replaces its stale copy in the tile
        last = ctx - 1
        last_per_pair = half * 0 + last
        in_first = (last_per_pair >= start) & (last_per_pair < tl.minimum(start + BLOCK_N, end))
        new_page = tl.load(table + tl.maximum(last, 0) // BLOCK_SIZE).to(tl.int64)
        new_row = ((new_page * BLOCK_SIZE + tl.maximum(last, 0) % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM // 2)
                   + kvh * (HEAD_DIM // 2) + half)
        gdc_wait()
        k_new = tl.load(k_cache_ptr.to(tl.pointer_type(tl.uint16)) + new_row, mask=in_first, other=0)
        v_new = tl.load(v_cache_ptr.to(tl.pointer_type(tl.uint16)) + new_row, mask=in_first, other=0)
        is_new = (tok == last)[:, None]
        k_even = tl.where(is_new, _widen_e4m3(k_new & 0xFF)[None, :], k_even)
        k_odd = tl.where(is_new, _widen_e4m3(k_new >> 8)[None, :], k_odd)
        v_even = tl.where(is_new, _widen_e4m3(v_new & 0xFF)[None, :], v_even)
        v_odd = tl.where(is_new, _widen_e4m3(v_new >> 8)[None, :], v_odd)
    q_rows = q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * HEAD_DIM + 2 * half[None, :]
    q_mask = row_mask[:, None]
    q_even = (tl.load(q_rows, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    q_odd = (tl.load(q_rows + 1, mask=q_mask, other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc_even = tl.zeros([GROUP_PAD, HEAD_DIM // 2], dtype=tl.float32)
    acc_odd = tl.zeros([GROUP_PAD, HEAD_DIM // 2], dtype=tl.float32)
    if start < end:   # (an empty context: nothing to attend, zeros out)
        m_i, l_i, acc_even, acc_odd = _attend_pairs(q_even, q_odd, k_even, k_odd, v_even, v_odd, tok < end, m_i,
                                                    l_i, acc_even, acc_odd)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        tile = n0 + tl.arange(0, BLOCK_N)
        k_even, k_odd, v_even, v_odd = _kv_pairs_fp8(k_cache_ptr, v_cache_ptr, table, tile, end, kvh,
                                                     NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        m_i, l_i, acc_even, acc_odd = _attend_pairs(q_even, q_odd, k_even, k_odd, v_even, v_odd, tile < end, m_i,
                                                    l_i, acc_even, acc_odd)
    # the halves interleaved once: dimension 2i is the even half's i-th, 2i + 1 the odd half's
    return m_i, l_i, tl.reshape(tl.join(acc_even, acc_odd), (GROUP_PAD, HEAD_DIM))


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One online-softmax step over a KV tile: the updated (running max, running sum, accumulator)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _decode_output(acc, m_i, l_i, seq, kvh, split, active, num_splits, out_ptr, part_ptr, lse_ptr, count_ptr,
                   stride_ot, heads, rows, dims, row_mask, dim_mask, NUM_KV_HEADS: tl.constexpr,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr, S_PAD: tl.constexpr):
    """Write a split's result: the output itself (one split), or its partial and log-sum-exp, the last split
    of the (sequence, KV head) to finish merging all of them into the output."""
    out_mask = row_mask[:, None] & dim_mask[None, :]
    out_rows = out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * HEAD_DIM + dims[None, :]
    if not SPLIT or active == 1:   # one split (by launch or by a short context): no partials, no merge
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(out_rows, (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials [B, H, S, D] and log2-sum-exp [B, H, S]; an empty split has lse -inf.
        first_row = (seq * NUM_KV_HEADS * GROUP + heads).to(tl.int64) * num_splits
        safe_l = tl.where(l_i > 0, l_i, 1.0)
        tl.store(part_ptr + (first_row + split)[:, None] * HEAD_DIM + dims[None, :], acc / safe_l[:, None],
                 mask=out_mask)
        tl.store(lse_ptr + first_row + split, tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf")),
                 mask=row_mask)
        # The last split of this (sequence, KV head) to finish merges all of them, then resets the counter for
        # the next launch (or graph replay): no second kernel.
        tl.debug_barrier()
        counter = count_ptr + seq * NUM_KV_HEADS + kvh
        if tl.atomic_add(counter, 1, sem="acq_rel") == active - 1:
            splits = tl.arange(0, S_PAD)
            split_mask = splits < active
            for g in tl.static_range(GROUP):   # every split of a head in one load: no serial chain of loads
                first = (seq * NUM_KV_HEADS * GROUP + kvh * GROUP + g).to(tl.int64) * num_splits
                lse = tl.load(lse_ptr + first + splits, mask=split_mask, other=float("-inf"), cache_modifier=".cg")
                part = tl.load(part_ptr + (first + splits)[:, None] * HEAD_DIM + dims[None, :],
                               mask=split_mask[:, None] & dim_mask[None, :], other=0.0, cache_modifier=".cg")
                top = tl.max(lse, 0)
                weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
                total = tl.sum(weight, 0)
                merged = tl.sum(part * (weight / tl.where(total > 0, total, 1.0))[:, None], 0)
                tl.store(out_ptr + seq.to(tl.int64) * stride_ot + (kvh * GROUP + g) * HEAD_DIM + dims,
                         merged.to(out_ptr.dtype.element_ty), mask=dim_mask)
            tl.atomic_xchg(counter, 0)


@triton.jit
def _decode_plain(q_ptr, k_cache_ptr, v_cache_ptr, table, seq, kvh, ctx, start, end, heads, row_mask, dims, dim_mask,
                  stride_qt, qk_scale, NUM_KV_HEADS: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                  FP16_DOTS: tl.constexpr, PDL: tl.constexpr):
    """The decode kernel's attention over tiles read in the cache's dtype (``_kv_tile``): (running max, running
    sum, accumulator) of the split, the first tile read before the ``PDL`` wait."""
    tok = start + tl.arange(0, BLOCK_N)
    k_first, v_first = _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, dims, dim_mask, NUM_KV_HEADS,
                                HEAD_DIM, BLOCK_SIZE)
    if PDL:   # the new token's row, stored by the kernel just before, replaces its stale copy in the tile
        last = ctx - 1
        last_per_dim = dims * 0 + last   # (a scalar condition as a mask fails in Triton's interpreter)
        in_first = (last_per_dim >= start) & (last_per_dim < tl.minimum(start + BLOCK_N, end))
        new_page = tl.load(table + tl.maximum(last, 0) // BLOCK_SIZE).to(tl.int64)
        new_row = ((new_page * BLOCK_SIZE + tl.maximum(last, 0) % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
                   + kvh * HEAD_DIM + dims)
        gdc_wait()
        new_mask = dim_mask & in_first
        k_new = tl.load(k_cache_ptr + new_row, mask=new_mask, other=0.0)
        v_new = tl.load(v_cache_ptr + new_row, mask=new_mask, other=0.0)
        is_new = (tok == last)[:, None]
        k_first = tl.where(is_new, k_new[None, :], k_first)
        v_first = tl.where(is_new, v_new[None, :], v_first)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP16_DOTS:
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    if start < end:   # (an empty context: nothing to attend, zeros out)
        # float8 caches widen here, to the query's dtype
        m_i, l_i, acc = _attend_tile(q, k_first.to(q.dtype), v_first.to(q.dtype), tok < end, m_i, l_i, acc,
                                     qk_scale, PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        tile = n0 + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, tile, end, kvh, dims, dim_mask, NUM_KV_HEADS, HEAD_DIM,
                        BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(q, k.to(q.dtype), v.to(q.dtype), tile < end, m_i, l_i, acc, qk_scale,
                                     PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, count_ptr,
                   stride_qt, stride_ot, stride_table, scale, num_splits, window,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr, SPLIT: tl.constexpr, S_PAD: tl.constexpr,
                   PRECISION: tl.constexpr, HEADS_FIRST: tl.constexpr, FP16_DOTS: tl.constexpr,
                   FP8_PAIRS: tl.constexpr, PDL: tl.constexpr):
    """Split-KV decode attention of one (sequence, KV head, split). What the step's host copy and earlier steps
    wrote (lengths, block table, the split's first KV tile) is read before waiting on the kernel just before
    this one; after the wait, the query and the new token's key and value row, which that kernel stored (its
    stale copy in the prefetched tile is replaced). With ``FP16_DOTS`` (a float8 cache) the dot products take
    float16 operands: e4m3 codes widen to float16 exactly, two to an instruction, where widening to bfloat16
    goes through float32; the query is scaled before it is rounded to float16. With ``FP8_PAIRS`` (a float8
    cache, float16 dots, a power-of-two head size of at least 32) the codes are widened as they are loaded and
    the dot products run over even and odd dimensions apart (``_decode_fp8_pairs``)."""
    seq, kvh, split, ctx, start, end, active = _decode_program(lens_ptr, num_splits, window, BLOCK_N, SPLIT_MIN,
                                                               HEADS_FIRST, PDL)
    if split >= active:
        return

    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, D_PAD)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    heads = kvh * GROUP + rows
    table = tables_ptr + seq.to(tl.int64) * stride_table
    qk_scale = scale * 1.4426950408889634
    if FP8_PAIRS:
        m_i, l_i, acc = _decode_fp8_pairs(q_ptr, k_cache_ptr, v_cache_ptr, table, seq, kvh, ctx, start, end, heads,
                                          row_mask, stride_qt, qk_scale, NUM_KV_HEADS, GROUP_PAD, HEAD_DIM,
                                          BLOCK_SIZE, BLOCK_N, PDL)
    else:
        m_i, l_i, acc = _decode_plain(q_ptr, k_cache_ptr, v_cache_ptr, table, seq, kvh, ctx, start, end, heads,
                                      row_mask, dims, dim_mask, stride_qt, qk_scale, NUM_KV_HEADS, GROUP_PAD,
                                      HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, PRECISION, FP16_DOTS, PDL)
    _decode_output(acc, m_i, l_i, seq, kvh, split, active, num_splits, out_ptr, part_ptr, lse_ptr, count_ptr,
                   stride_ot, heads, rows, dims, row_mask, dim_mask, NUM_KV_HEADS, GROUP, HEAD_DIM, SPLIT, S_PAD)


@triton.jit
def _packed_decode_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                          tables_ptr, lens_ptr, out_ptr, part_ptr, lse_ptr, count_ptr, stride_qkv, stride_cos,
                          stride_ot, stride_table, scale, eps, num_splits, window,
                          NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                          GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_N: tl.constexpr, SPLIT_MIN: tl.constexpr, SPLIT: tl.constexpr,
                          S_PAD: tl.constexpr, PRECISION: tl.constexpr, HAS_NORM: tl.constexpr,
                          HEADS_FIRST: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    """Decode attention straight from the fused QKV projection: each program prepares its query heads and its
    KV head's new key and value (per-head RMSNorm, rotary embedding; the split holding the new token stores
    them in the cache), and attends. Everything but the projection's output (the step's metadata, the cached
    context's first tile (with ``PREFETCH``), the rotary row, the norm weights) is read before waiting on the
    kernel before it."""
    seq, kvh, split, ctx, start, end, active = _decode_program(lens_ptr, num_splits, window, BLOCK_N, SPLIT_MIN,
                                                               HEADS_FIRST, PDL)
    if split >= active:
        return
    half: tl.constexpr = HEAD_DIM // 2
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    rot = (dims + half) % HEAD_DIM                  # rotate-half partner of each dimension
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_DIM
    table = tables_ptr + seq.to(tl.int64) * stride_table
    tok = start + tl.arange(0, BLOCK_N)
    if PREFETCH:
        k_first, v_first = _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, dims, dim_mask,
                                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
    pos = tl.load(pos_ptr + seq).to(tl.int64)
    new_slot = tl.load(slot_ptr + seq).to(tl.int64)
    cos = tl.load(cos_ptr + pos * stride_cos + dims % half).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + dims % half).to(tl.float32) * tl.where(dims < half, -1.0, 1.0)
    if HAS_NORM:
        qw, qw_rot = tl.load(qw_ptr + dims).to(tl.float32), tl.load(qw_ptr + rot).to(tl.float32)
        kw, kw_rot = tl.load(kw_ptr + dims).to(tl.float32), tl.load(kw_ptr + rot).to(tl.float32)
    if PDL:
        gdc_wait()
    if not PREFETCH:
        k_first, v_first = _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, end, kvh, dims, dim_mask,
                                    NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)

    row = qkv_ptr + seq.to(tl.int64) * stride_qkv
    heads = kvh * GROUP + rows
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(row + heads[:, None] * HEAD_DIM + dims[None, :], mask=q_mask, other=0.0)
    dtype = q.dtype
    q = q.to(tl.float32)
    q_rot = tl.load(row + heads[:, None] * HEAD_DIM + rot[None, :], mask=q_mask, other=0.0).to(tl.float32)
    k_row = row + (NUM_HEADS + kvh) * HEAD_DIM
    k = tl.load(k_row + dims).to(tl.float32)
    k_rot = tl.load(k_row + rot).to(tl.float32)
    v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + kvh) * HEAD_DIM + dims)
    if HAS_NORM:  # the reference rounds the norm's output to the model dtype before the rotation
        q_scale = tl.rsqrt(tl.sum(q * q, 1) / HEAD_DIM + eps)[:, None]
        k_scale = tl.rsqrt(tl.sum(k * k, 0) / HEAD_DIM + eps)
        q, q_rot = (q * q_scale * qw).to(dtype).to(tl.float32), (q_rot * q_scale * qw_rot).to(dtype).to(tl.float32)
        k, k_rot = (k * k_scale * kw).to(dtype).to(tl.float32), (k_rot * k_scale * kw_rot).to(dtype).to(tl.float32)
    q = (q * cos[None, :] + q_rot * sin[None, :]).to(dtype)
    k_new = (k * cos + k_rot * sin).to(k_cache_ptr.dtype.element_ty)
    v_new = v.to(tl.float32).to(v_cache_ptr.dtype.element_ty)
    last = ctx - 1
    if (last >= start) & (last < end) & (new_slot >= 0):   # one program per (sequence, KV head) stores
        dst = new_slot * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + dims
        tl.store(k_cache_ptr + dst, k_new)
        tl.store(v_cache_ptr + dst, v_new)
    k_new = k_new.to(dtype)
    v_new = v_new.to(dtype)
    qk_scale = scale * 1.4426950408889634

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    if start < end:   # (an empty context: nothing to attend, zeros out)
        is_new = (tok == last)[:, None]    # the cache row read early is stale for the new token: use its values
        m_i, l_i, acc = _attend_tile(q, tl.where(is_new, k_new[None, :], k_first.to(dtype)),
                                     tl.where(is_new, v_new[None, :], v_first.to(dtype)), tok < end, m_i, l_i,
                                     acc, qk_scale, PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        tile = n0 + tl.arange(0, BLOCK_N)
        k_tile, v_tile = _kv_tile(k_cache_ptr, v_cache_ptr, table, tile, end, kvh, dims, dim_mask, NUM_KV_HEADS,
                                  HEAD_DIM, BLOCK_SIZE)
        tile_new = (tile == last)[:, None]
        m_i, l_i, acc = _attend_tile(q, tl.where(tile_new, k_new[None, :], k_tile.to(dtype)),
                                     tl.where(tile_new, v_new[None, :], v_tile.to(dtype)), tile < end, m_i, l_i,
                                     acc, qk_scale, PRECISION)
    _decode_output(acc, m_i, l_i, seq, kvh, split, active, num_splits, out_ptr, part_ptr, lse_ptr, count_ptr,
                   stride_ot, heads, rows, dims, row_mask, dim_mask, NUM_KV_HEADS, GROUP, HEAD_DIM, SPLIT, S_PAD)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _whole_context_fits(device_index: int) -> bool:
    """Whether a program may take the whole-context tile's shared memory (about 132 KB: Hopper and A100 have
    more, smaller GPUs do not)."""
    props = torch.cuda.get_device_properties(device_index)
    return getattr(props, "shared_memory_per_block_optin", 0) >= WHOLE_CONTEXT_SHARED_BYTES


# Warps of a decode program at small batch (≤ 16 rows). Qwen3-0.6B at batch 1 (H200, engine latency bench):
# 2 warps 1,381.6 tok/s, 4 warps 1,387.1, 8 warps with 256-token splits 1,376.2 (within run-to-run noise).
SMALL_BATCH_WARPS = 2


# Context tokens a decode split covers at least when the split count follows the step's contexts.
SPLIT_TOKENS = 32

# A one-row decode step whose context is at most ``ONE_ROW_WHOLE_CONTEXT`` tokens attends it in one tile per KV
# head, ``WHOLE_CONTEXT_TILE`` wide: one split, so no partial results to merge, and the whole context read
# before the wait on the kernel before (kernels/pdl.py). With 8 splits of 32 tokens, the attention kernel ended
# about 10 µs after the QKV preparation before it, of a 25 µs layer (H100, Qwen3-0.6B, batch 1, context 256).
# Measured on an H100 (`pocketllm bench latency`, prompt 128, 128 tokens): Qwen3-0.6B 1,354.3, 1,349.2 and
# 1,354.8 tok/s against 1,337.6, 1,338.7 and 1,340.9 with the splits; Llama-3-8B with float8 weights 319.6,
# 319.1 and 317.6 against 314.4 and 314.5. 0 turns the rule off.
ONE_ROW_WHOLE_CONTEXT = 256
WHOLE_CONTEXT_TILE = 256
WHOLE_CONTEXT_WARPS = 16
WHOLE_CONTEXT_SHARED_BYTES = 160 << 10


def decode_splits(batch: int, num_kv_heads: int, max_splits: int = 16, max_context: int | None = None,
                  whole_context: int | None = None) -> int:
    """Context splits per sequence so that batch × KV heads × splits fills the GPU about twice; given the step's
    longest context, no more than the power of two that cuts it into pieces of ``SPLIT_TOKENS``, and one for a
    one-row step within ``whole_context`` tokens (default ``ONE_ROW_WHOLE_CONTEXT``; 0: never). Programs past a
    context's active splits return at once but still cost: Qwen3-0.6B at batch 1 and contexts up to 256 (H200)
    decoded 1,443-1,461 tok/s with 4 splits of 64 tokens launched against 1,398-1,417 with 16 (of which 4
    active); 8 splits of one 32-token tile each (``decode_tile``) took it to 1,481-1,518."""
    target = 2 * _num_sms(torch.cuda.current_device())
    fill = max(1, min(max_splits, -(-target // max(1, batch * num_kv_heads))))
    if max_context is None:
        return fill
    if _one_tile(batch, whole_context) and max_context <= _whole(whole_context):
        return 1
    pieces = max(1, -(-max_context // SPLIT_TOKENS))
    return min(fill, 1 << (pieces - 1).bit_length())


def _whole(whole_context: int | None) -> int:
    return ONE_ROW_WHOLE_CONTEXT if whole_context is None else whole_context


def _one_tile(batch: int, whole_context: int | None) -> bool:
    """Whether a one-tile launch may serve this batch: one row, the rule on, the GPU's shared memory enough."""
    return batch == 1 and _whole(whole_context) > 0 and _whole_context_fits(torch.cuda.current_device())


def decode_tile(batch: int, num_kv_heads: int, num_splits: int, whole_context: int | None = None) -> int | None:
    """The KV tile width for a decode launch of ``num_splits`` splits. One split of one row under the
    ``whole_context`` rule (``decode_splits``) reads its context in tiles of ``WHOLE_CONTEXT_TILE``. Another count
    below the one that fills the GPU was chosen from the contexts, so every split is at most ``SPLIT_TOKENS``
    long and one tile that wide covers it. Otherwise None: the kernel's default (64 tokens in 16-bit), as longer
    splits loop over fewer, wider tiles (32-token tiles there took Qwen3-0.6B at context 2,048 from 1,157 to
    1,062-1,065 tok/s)."""
    fill = decode_splits(batch, num_kv_heads)
    if num_splits == 1 < fill and _one_tile(batch, whole_context):
        return WHOLE_CONTEXT_TILE
    return SPLIT_TOKENS if num_splits < fill else None


def decode_split_options(batch: int, num_kv_heads: int, whole_context: int | None = None) -> list[int]:
    """Every split count ``decode_splits`` gives for this batch size, whatever the contexts."""
    fill = decode_splits(batch, num_kv_heads)
    return sorted({decode_splits(batch, num_kv_heads, max_context=SPLIT_TOKENS << i, whole_context=whole_context)
                   for i in range(fill.bit_length() + 1)})


class _DecodeLaunch(NamedTuple):
    """Launch settings of a decode kernel."""

    block_n: int
    num_warps: int
    num_stages: int
    heads_first: bool


def _decode_launch(batch: int, dtype: torch.dtype, d_pad: int, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None,
                   heads_first: bool | None = None, kv_bytes: int = 2) -> _DecodeLaunch:
    """The decode kernels' settings, each given one kept. Measured on an H200 at batch 1 (Llama-3-8B heads,
    contexts 256 and 2048): two warps and three stages took 6.5 and 9.5 µs against 9.0 and 10.7 µs with four
    warps and two; larger batches keep four. Heads over 128 keep two stages (three K/V tiles of 256-wide
    heads would not fit smaller GPUs' shared memory). At batch 256 (Qwen3-0.6B heads, context 800, pages
    spread over the cache) three stages and the grid ordered KV heads first took 199 µs against 217 µs with
    two stages in sequence order (4.2 against 3.9 TB/s of KV reads). A float8 cache (``kv_bytes`` 1) takes
    128-token tiles at large batch (186 against 191 µs there)."""
    small = batch <= 16
    if block_n == WHOLE_CONTEXT_TILE and small:   # one tile, no loop: one stage, and wider heads or float32
        # tiles hold at most as many bytes as 16-bit 128-wide ones (the one split then loops over a few)
        tile = min(WHOLE_CONTEXT_TILE,
                   WHOLE_CONTEXT_TILE * 256 // (d_pad * max(2, kv_bytes, torch.finfo(dtype).bits // 8)))
        return _DecodeLaunch(tile, num_warps or WHOLE_CONTEXT_WARPS, num_stages or 1,
                             False if heads_first is None else heads_first)
    return _DecodeLaunch(
        block_n or (32 if dtype == torch.float32 else 128 if kv_bytes == 1 and not small else 64),
        num_warps or (SMALL_BATCH_WARPS if small else 4),
        num_stages or (3 if d_pad <= 128 else 2),
        not small if heads_first is None else heads_first)


def _split_buffers(batch: int, num_heads: int, num_kv_heads: int, num_splits: int, head_dim: int,
                   counters: torch.Tensor | None, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(partials, log-sum-exps, counters) of a split decode launch; ``out`` three times for one split."""
    if num_splits == 1:
        return out, out, out
    part = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)
    if counters is None:
        counters = torch.zeros(batch * num_kv_heads, dtype=torch.int32, device=out.device)
    elif counters.numel() < batch * num_kv_heads:
        raise ValueError("split counters smaller than batch × KV heads")
    return part, lse, counters


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, num_splits: int, out: torch.Tensor | None = None,
                 counters: torch.Tensor | None = None, block_n: int | None = None, num_warps: int | None = None,
                 num_stages: int | None = None, heads_first: bool | None = None, split_min: int | None = None,
                 window: int | None = None, fp16_dots: bool | None = None,
                 fp8_pairs: bool | None = None) -> torch.Tensor:
    """One query token per sequence: ``q`` [B, H, D] (heads contiguous) → [B, H, D]. A split covers at least
    ``split_min`` context tokens (rounded up to whole KV tiles), so shorter contexts use fewer splits.
    ``window``: a sliding window (None: full attention). ``fp16_dots`` (default: for a float8 cache) runs the dot
    products on float16 operands; ``fp8_pairs`` (default: off) widens a float8 cache's codes where they are
    loaded (refused without float16 dots and a power-of-two head size of at least 32). It is kept for study: on
    an H100 its kernel was 5% faster than the plain read at batch 256, and the engine's throughput did not move.

    With ``num_splits`` > 1, ``counters`` (int32, at least B × KV heads, zero; left zero) count the finished
    splits of each (sequence, KV head), so that the last one merges the partial results in the same launch;
    without it a zeroed buffer is allocated."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
    d_pad = _pow2(head_dim)
    c = _decode_launch(batch, q.dtype, d_pad, block_n, num_warps, num_stages, heads_first, k_cache.element_size())
    split_min = -(-(split_min or c.block_n) // c.block_n) * c.block_n
    part, lse, counters = _split_buffers(batch, num_heads, num_kv_heads, num_splits, head_dim, counters, out)
    fp8 = k_cache.element_size() == 1
    fp16_dots = fp8 if fp16_dots is None else fp16_dots
    if fp8_pairs and not (fp8 and fp16_dots and head_dim == d_pad and head_dim >= 32):
        raise ValueError("fp8_pairs needs a float8 cache, float16 dot products and a power-of-two head size of at "
                         "least 32")
    pdl, launch = launch_options(q, batch)
    grid = (num_kv_heads, batch, num_splits) if c.heads_first else (batch, num_kv_heads, num_splits)
    _decode_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, out, part, lse, counters,
        q.stride(0), out.stride(0), block_tables.stride(0), scale, num_splits, window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, _pow2(group)), HEAD_DIM=head_dim,
        D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_N=c.block_n, SPLIT_MIN=split_min, SPLIT=num_splits > 1,
        S_PAD=_pow2(num_splits), PRECISION=_dot_precision(q.dtype), HEADS_FIRST=c.heads_first,
        FP16_DOTS=fp16_dots, FP8_PAIRS=bool(fp8_pairs), num_warps=c.num_warps, num_stages=c.num_stages, PDL=pdl,
        **launch)
    return out


def packed_decode_supported(head_dim: int) -> bool:
    """Whether ``paged_decode_packed`` takes this head size (a power of two: the rotation pairs dimension
    ``d`` with ``(d + D/2) mod D`` within one tile)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def paged_decode_packed(qkv: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                        sin_cache: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                        eps: float, num_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, num_splits: int,
                        counters: torch.Tensor | None = None, num_warps: int | None = None,
                        heads_first: bool | None = None, prefetch: bool = True,
                        block_n: int | None = None, window: int | None = None) -> torch.Tensor:
    """One query token per sequence, from the fused projection ``qkv`` [B, (H + 2 KVH) * D]: what
    ``qkv_prepare`` then ``paged_decode`` compute (per-head q/k RMSNorm when weights are given, rotary
    embedding, the new key and value stored at ``slot_mapping``, attention over the context including the
    new token) in one launch → [B, H, D]. ``window``: a sliding window (None: full attention)."""
    batch = qkv.shape[0]
    if not packed_decode_supported(head_dim) or qkv.stride(1) != 1:
        raise ValueError("packed decode needs a power-of-two head size and a row-major projection")
    out = torch.empty(batch, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    part, lse, counters = _split_buffers(batch, num_heads, num_kv_heads, num_splits, head_dim, counters, out)
    has_norm = q_weight is not None
    pdl, launch = launch_options(qkv, batch)
    group = num_heads // num_kv_heads
    c = _decode_launch(batch, qkv.dtype, head_dim, block_n, num_warps=num_warps, heads_first=heads_first)
    grid = (num_kv_heads, batch, num_splits) if c.heads_first else (batch, num_kv_heads, num_splits)
    _packed_decode_kernel[grid](
        qkv, positions, cos_cache, sin_cache, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        slot_mapping, k_cache, v_cache, block_tables, context_lens, out, part, lse, counters,
        qkv.stride(0), cos_cache.stride(0), out.stride(0), block_tables.stride(0), scale, eps, num_splits,
        window or 0, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, _pow2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=c.block_n, SPLIT_MIN=c.block_n,
        SPLIT=num_splits > 1, S_PAD=_pow2(num_splits), PRECISION=_dot_precision(qkv.dtype), HAS_NORM=has_norm,
        HEADS_FIRST=c.heads_first, PREFETCH=prefetch, num_warps=c.num_warps, num_stages=c.num_stages, PDL=pdl,
        **launch)
    return out


# ------------------------------------------------------------------------------------------------ prefill

@triton.jit(do_not_specialize=["first_seq"])
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, qstart_ptr, out_ptr,
                    stride_qt, stride_ot, stride_table, scale, first_seq, window,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    PRECISION: tl.constexpr):
    m_block = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2) + first_seq
    kvh = head // GROUP
    q_begin = tl.load(qstart_ptr + seq)
    q_len = tl.load(qstart_ptr + seq + 1) - q_begin
    ctx = tl.load(lens_ptr + seq)
    prefix = ctx - q_len

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, D_PAD)
    row_mask = rows < q_len
    dim_mask = dims < HEAD_DIM
    q_pos = prefix + rows
    q_rows = (q_begin + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # Keys up to the last query row of this tile (causal); nothing for tiles past the chunk's end. Tiles of
    # keys at or before the tile's first query position need no causal mask: they run first, unmasked.
    # With a sliding window, every tile from the one holding the first row's oldest key is masked, per row.
    hi = tl.where(m_block * BLOCK_M < q_len, tl.minimum(ctx, prefix + (m_block + 1) * BLOCK_M), 0)
    full = tl.minimum((prefix + m_block * BLOCK_M + 1) // BLOCK_N * BLOCK_N, hi)
    lo = tl.where(window > 0, tl.maximum(prefix + m_block * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
    full = tl.where(window > 0, lo, full)
    oldest = tl.where(window > 0, q_pos - window, -1)   # per row: keys at or before it are outside the window
    table = tables_ptr + seq.to(tl.int64) * stride_table
    for n0 in range(lo, full, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, hi, kvh, dims, dim_mask, NUM_KV_HEADS, HEAD_DIM,
                        BLOCK_SIZE)
        m_i, l_i, acc = _attend_tile(q, k.to(q.dtype), v.to(q.dtype), tok < hi, m_i, l_i, acc, qk_scale,
                                     PRECISION)
    for n0 in range(full, hi, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        k, v = _kv_tile(k_cache_ptr, v_cache_ptr, table, tok, hi, kvh, dims, dim_mask, NUM_KV_HEADS, HEAD_DIM,
                        BLOCK_SIZE)   # float8 caches widen below
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        causal = (tok < hi)[None, :] & (tok[None, :] <= q_pos[:, None]) & (tok[None, :] > oldest[:, None])
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    safe_l = tl.where(l_i > 0, l_i, 1.0)
    out = acc / safe_l[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * HEAD_DIM + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  context_lens: torch.Tensor, query_start: torch.Tensor, max_query_len: int, scale: float,
                  out: torch.Tensor | None = None, block_m: int | None = None, block_n: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, first_seq: int = 0,
                  window: int | None = None) -> torch.Tensor:
    """Chunks of any length in one launch, each over its cached prefix plus itself (causal; with ``window``,
    each query over the last ``window`` positions only).

    ``q`` [T, H, D] holds sequence ``i``'s queries at ``query_start[i]:query_start[i+1]``; their keys and
    values must already be in the cache. Returns [T, H, D]; with ``first_seq`` only the rows of sequences
    ``first_seq`` onwards are computed (written into ``out``).
    """
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    batch = context_lens.shape[0] - first_seq
    if out is None:
        out = torch.empty_like(q)
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.stride(2) == 1 and out.stride(1) == head_dim
    d_pad = _pow2(head_dim)
    fp32 = q.dtype == torch.float32
    # bf16, heads of 128, a throughput workload's 8192-token chunk of fresh prompts (H200): 64 × 32 tiles and
    # three stages took 130 µs against 138 µs with 64 × 64 and two (16 query heads; 32: 243 against 257 µs).
    block_m = block_m or (32 if fp32 else (64 if d_pad <= 128 else 32))
    block_n = block_n or (32 if fp32 or d_pad <= 128 else 64)
    if max_query_len <= 16:
        block_m = 16
    grid = (triton.cdiv(max_query_len, block_m), num_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, context_lens, query_start, out,
        q.stride(0), out.stride(0), block_tables.stride(0), scale, first_seq, window or 0,
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(q.dtype),
        num_warps=num_warps or 4, num_stages=num_stages or (3 if d_pad <= 128 else 2))
    return out
