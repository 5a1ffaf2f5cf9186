"""The Triton attention kernels under a sliding window, against the PyTorch reference backend (marked ``gpu``).

Run on a CUDA machine with ``pytest -m gpu tests/test_sliding_window_gpu.py``; the float32 cases also run
without a GPU under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors).
"""

from __future__ import annotations

import os

import pytest
import torch

from pocketllm.layers.attention import Attention
from pocketllm.layers.attention_backend import TorchAttentionBackend, TritonAttentionBackend
from pocketllm.step.attention_metadata import AttentionMetadata

pytestmark = pytest.mark.gpu

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 96


def _need_kernels(dtype: torch.dtype) -> None:
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (or TRITON_INTERPRET=1)")
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 dot products wrongly; run on a GPU")


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def _layer(window: int, dtype: torch.dtype, seed: int) -> Attention:
    torch.manual_seed(seed)
    layer = Attention(HEADS, HEAD_DIM, KV_HEADS, HEAD_DIM ** -0.5, sliding_window=window)
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    layer.k_cache = torch.randn(shape, device=DEVICE).to(dtype)
    layer.v_cache = torch.randn(shape, device=DEVICE).to(dtype)
    return layer


def _tables(lens: list[int], seed: int) -> torch.Tensor:
    """Disjoint shuffled pages per sequence, padded with 0."""
    need = [-(-n // BLOCK_SIZE) for n in lens]
    pages = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[: sum(need)].tolist()
    rows, at = [], 0
    for n in need:
        rows.append(pages[at:at + n] + [0] * (max(need) - n))
        at += n
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE)


def _meta(shapes: list[tuple[int, int]], tables: torch.Tensor, splits: int) -> AttentionMetadata:
    """Kernel metadata of a step of (context, new tokens) chunks, one-token rows first."""
    lens = [c for c, _ in shapes]
    starts = [0]
    for _, n in shapes:
        starts.append(starts[-1] + n)
    lead = sum(1 for _, n in shapes if n == 1) if starts[-1] > len(shapes) else 0
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int32, device=DEVICE), block_tables=tables, query_start=starts,
        context_lens=lens, block_size=BLOCK_SIZE,
        context_lens_gpu=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
        query_start_gpu=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        max_query_len=max(n for _, n in shapes), num_splits=splits, num_decode_rows=lead,
        split_counters=torch.zeros(len(shapes) * KV_HEADS, dtype=torch.int32, device=DEVICE))


def _reference(layer: Attention, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The PyTorch reference backend over float32 copies of the same cache (nothing new stored)."""
    ref = Attention(HEADS, HEAD_DIM, KV_HEADS, layer.scale, sliding_window=layer.sliding_window)
    ref.k_cache, ref.v_cache = layer.k_cache.float(), layer.v_cache.float()
    plain = AttentionMetadata(torch.zeros(0, dtype=torch.long, device=DEVICE), meta.block_tables.long(),
                              meta.query_start, meta.context_lens, BLOCK_SIZE)
    empty = torch.zeros(0, KV_HEADS, HEAD_DIM, device=DEVICE)
    return TorchAttentionBackend().forward(ref, q.float(), empty, empty, plain)


# (context, new tokens): decode rows of contexts inside, across and far past the window, then prompt chunks
# (a fresh prompt, a chunk after a cached prefix).
MIXED = [(50, 1), (3, 1), (130, 1), (37, 37), (90, 21)]
MIXED_INTERPRET = [(50, 1), (3, 1), (45, 9), (20, 20)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_decode_and_prefill_kernels_mask_keys_outside_the_window(dtype, splits, window):
    _need_kernels(dtype)
    shapes = MIXED_INTERPRET if INTERPRET else MIXED
    layer = _layer(window, dtype, seed=window + splits)
    tables = _tables([c for c, _ in shapes], seed=window)
    meta = _meta(shapes, tables, splits)
    q = torch.randn(meta.query_start[-1], HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    out = TritonAttentionBackend().attend(layer, q, meta)
    ref = _reference(layer, q, meta)
    lead = meta.num_decode_rows
    assert _rel(out[:lead], ref[:lead]) < TOL[dtype]
    assert _rel(out[lead:], ref[lead:]) < TOL[dtype]
    assert not meta.split_counters.any()
    # decode rows alone (a decode-only step)
    decode = [(c, 1) for c, _ in shapes]
    meta = _meta(decode, tables, splits)
    q = torch.randn(len(decode), HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    assert _rel(TritonAttentionBackend().attend(layer, q, meta), _reference(layer, q, meta)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_packed_decode_masks_keys_outside_the_window(dtype, splits):
    """The one-launch decode from the QKV projection equals ``qkv_prepare`` then the windowed decode kernel."""
    _need_kernels(dtype)
    if INTERPRET and splits == 4:
        pytest.skip("slow in the interpreter")
    from pocketllm.kernels.attention import paged_decode, paged_decode_packed
    from pocketllm.kernels.fused import qkv_prepare
    from pocketllm.layers.rotary import RotaryEmbedding

    window = 20
    lens = [1, 17, 150, 64] if not INTERPRET else [1, 17, 70]
    layer = _layer(window, dtype, seed=splits)
    tables = _tables(lens, seed=splits)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    positions = torch.tensor([n - 1 for n in lens], device=DEVICE)
    slots = torch.tensor([int(tables[i, (n - 1) // BLOCK_SIZE]) * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
                          for i, n in enumerate(lens)], dtype=torch.int32, device=DEVICE)
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 512, 10000.0).to(DEVICE)
    qkv = torch.randn(len(lens), (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEVICE).to(dtype)
    ref_k, ref_v = layer.k_cache.clone(), layer.v_cache.clone()
    q = qkv_prepare(qkv, positions, rope.cos_cache, rope.sin_cache, None, None, 0.0, HEADS, KV_HEADS, HEAD_DIM,
                    ref_k, ref_v, slots)
    ref = paged_decode(q, ref_k, ref_v, tables, ctx, layer.scale, splits, window=window)
    full = paged_decode(q, ref_k, ref_v, tables, ctx, layer.scale, splits)
    assert _rel(full[2:], ref[2:]) > 10 * TOL[dtype]   # the window changes the long rows
    counters = torch.zeros(len(lens) * KV_HEADS, dtype=torch.int32, device=DEVICE)
    out = paged_decode_packed(qkv, positions, rope.cos_cache, rope.sin_cache, None, None, 0.0, HEADS, KV_HEADS,
                              HEAD_DIM, layer.k_cache, layer.v_cache, slots, tables, ctx, layer.scale, splits,
                              counters, window=window)
    assert not counters.any()
    assert torch.equal(layer.v_cache, ref_v)
    assert _rel(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [5, 40])
def test_one_tile_decode_masks_keys_outside_the_window(dtype, window):
    """A one-row step attended in one whole-context tile (``ONE_ROW_WHOLE_CONTEXT``) equals the split launch."""
    _need_kernels(dtype)
    from pocketllm.kernels.attention import WHOLE_CONTEXT_TILE, paged_decode

    context = 45 if INTERPRET else 200
    layer = _layer(window, dtype, seed=window)
    tables = _tables([context], seed=window)
    ctx = torch.tensor([context], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, HEADS, HEAD_DIM, device=DEVICE).to(dtype)
    ref = paged_decode(q, layer.k_cache, layer.v_cache, tables, ctx, layer.scale, 4, window=window)
    out = paged_decode(q, layer.k_cache, layer.v_cache, tables, ctx, layer.scale, 1, block_n=WHOLE_CONTEXT_TILE,
                       window=window)
    assert _rel(out, ref) < TOL[dtype]
    assert _rel(out, paged_decode(q, layer.k_cache, layer.v_cache, tables, ctx, layer.scale, 1)) > 10 * TOL[dtype]
