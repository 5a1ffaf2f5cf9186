"""Temperature sampling of a batch in one pass over the logits (CUDA).

``token = argmax(logit / T + G)`` with ``G = -log(-log(u))`` a Gumbel variable per (row, token) and ``u``
uniform from Philox keyed by the row's seed: the Gumbel-max form of the exponential race the PyTorch
sampler uses (``argmax(logit / T - log q)``, ``q = -log u ~ Exp(1)``), so both draw from
``softmax(logit / T)``. The logits are read once in their own dtype, each vocabulary chunk keeping a running
maximum, and a second small launch merges the chunks: a [256, 151936] bfloat16 batch is read in one pass
instead of the ~10 float32 passes of the unfused form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pocketllm.kernels.pdl import gdc_launch_dependents, gdc_wait, launch_options


@triton.jit
def _gumbel_tile(base, cols, u, inv_temp, vocab, best_val, best_idx):
    """Fold one tile of Gumbel-perturbed scores into the running per-lane maxima."""
    mask = cols < vocab
    x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
    score = tl.where(mask, x * inv_temp - tl.log(-tl.log(u)), float("-inf"))
    better = score > best_val
    return tl.where(better, score, best_val), tl.where(better, cols, best_idx)


@triton.jit
def _gumbel_chunk_kernel(logits_ptr, temps_ptr, seeds_ptr, val_ptr, idx_ptr, vocab, stride_row, num_chunks,
                         CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Best Gumbel-perturbed score (and its lowest index) of one vocabulary chunk of one row. Philox makes four
    uniforms per counter; tile ``t`` of the chunk uses counters ``(chunk * CHUNK + t * 4 * BLOCK) / 4 + lane``,
    one per (row, token) for the whole row."""
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    inv_temp = 1.0 / tl.load(temps_ptr + row)
    seed = tl.load(seeds_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride_row
    lanes = tl.arange(0, BLOCK)
    best_val = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK], dtype=tl.int32)
    for offset in tl.static_range(0, CHUNK, 4 * BLOCK):
        first = chunk * CHUNK + offset
        u0, u1, u2, u3 = tl.rand4x(seed, first // 4 + lanes)
        best_val, best_idx = _gumbel_tile(base, first + lanes, u0, inv_temp, vocab, best_val, best_idx)
        best_val, best_idx = _gumbel_tile(base, first + BLOCK + lanes, u1, inv_temp, vocab, best_val, best_idx)
        best_val, best_idx = _gumbel_tile(base, first + 2 * BLOCK + lanes, u2, inv_temp, vocab, best_val, best_idx)
        best_val, best_idx = _gumbel_tile(base, first + 3 * BLOCK + lanes, u3, inv_temp, vocab, best_val, best_idx)
    top = tl.max(best_val, 0)
    # Lowest index among equal maxima, so the result does not depend on the lane layout.
    tl.store(val_ptr + row * num_chunks + chunk, top)
    tl.store(idx_ptr + row * num_chunks + chunk, tl.min(tl.where(best_val == top, best_idx, vocab), 0))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  chunk: int = 4096) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (any float dtype) drawn from ``softmax(logits / T)``.

    ``temperatures`` [B] float32 (> 0), ``seeds`` [B] int64 (one Philox key per row and step). Each row's
    vocabulary is spread over chunks (programs) whose maxima a second launch merges: the random numbers, not
    the memory traffic, bound this kernel, and one program per row left most of the GPU idle (168 µs for
    [256, 151936] on an H200).
    """
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        # tiles of 4 × block tokens (one Philox call); a small vocabulary gets one small chunk
        block = max(16, min(chunk // 4, triton.next_power_of_2(triton.cdiv(vocab, 4))))
        if vocab <= chunk:
            chunk = 4 * block
        num_chunks = triton.cdiv(vocab, chunk)
        vals, idx = _chunk_maxima(batch, num_chunks, logits.device)
        _gumbel_chunk_kernel[(batch, num_chunks)](logits, temperatures, seeds, vals, idx, vocab, logits.stride(0),
                                                  num_chunks, CHUNK=chunk, BLOCK=block, num_warps=4)
        _merge_chunk_maxima(vals, idx, out, vocab)
    return out


# ------------------------------------------------------------------------------------------------ greedy

@triton.jit
def _chunk_max_kernel(logits_ptr, val_ptr, idx_ptr, vocab, stride_row, num_chunks, CHUNK: tl.constexpr,
                      PDL: tl.constexpr):
    if PDL:   # (kernels/pdl.py) the merge may launch now; the logits are read after the wait
        gdc_launch_dependents()
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    if PDL:
        gdc_wait()
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=cols < vocab,
                other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)                 # NaN counts as the largest, as in torch.argmax
    top = tl.max(x, 0)
    first = tl.min(tl.where(x == top, cols, vocab), 0)   # lowest index among equal maxima, as torch.argmax
    tl.store(val_ptr + row * num_chunks + chunk, top)
    tl.store(idx_ptr + row * num_chunks + chunk, first)


@triton.jit
def _merge_max_kernel(val_ptr, idx_ptr, out_ptr, num_chunks, vocab, C_PAD: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    chunks = tl.arange(0, C_PAD)
    mask = chunks < num_chunks
    if PDL:
        gdc_wait()
    vals = tl.load(val_ptr + row * num_chunks + chunks, mask=mask, other=float("-inf"))
    idx = tl.load(idx_ptr + row * num_chunks + chunks, mask=mask, other=2**30)
    top = tl.max(vals, 0)
    best = tl.min(tl.where(vals == top, idx, 2**30), 0)
    tl.store(out_ptr + row, tl.minimum(best, vocab - 1).to(tl.int64))   # never an id outside the vocabulary


def _chunk_maxima(batch: int, num_chunks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (row, vocabulary chunk)'s best value and its index, filled by a chunk kernel."""
    return (torch.empty(batch, num_chunks, dtype=torch.float32, device=device),
            torch.empty(batch, num_chunks, dtype=torch.int32, device=device))


def _merge_chunk_maxima(vals: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, vocab: int) -> None:
    """``out[row]``: the index of the row's best chunk value (the lowest among ties)."""
    batch, num_chunks = vals.shape
    pdl, launch = launch_options(vals, batch)
    _merge_max_kernel[(batch,)](vals, idx, out, num_chunks, vocab, C_PAD=triton.next_power_of_2(num_chunks),
                                num_warps=1, PDL=pdl, **launch)


def greedy_argmax(logits: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``logits`` [B, V] (lowest index among ties), the vocabulary spread over many
    programs: one program per row took ~36 µs for a 128k vocabulary at batch 1."""
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        num_chunks = triton.cdiv(vocab, chunk)
        vals, idx = _chunk_maxima(batch, num_chunks, logits.device)
        pdl, launch = launch_options(logits, batch)
        _chunk_max_kernel[(batch, num_chunks)](logits, vals, idx, vocab, logits.stride(0), num_chunks, CHUNK=chunk,
                                               num_warps=4, PDL=pdl, **launch)
        _merge_chunk_maxima(vals, idx, out, vocab)
    return out
