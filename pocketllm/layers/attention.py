"""Attention over the paged KV cache: the PyTorch reference path (CPU, and any device without kernels), and
the dispatch to the Triton kernels when the model runner built kernel metadata (CUDA)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.step.attention_metadata import AttentionMetadata

# Decode steps of up to this many sequences prepare Q/K/V inside the attention kernel (one launch instead of
# two, and the cached context read while the QKV product finishes); larger batches keep two kernels (at batch
# 256 the packed kernel took 330 µs a layer against 217 µs for the two: it spills registers). Models with
# per-head q/k norms keep the two kernels too (``PACKED_DECODE_WITH_QK_NORM``): measured on an H200 at batch 1,
# Llama-3-8B went from 235.8 to 241.1 tok/s with it, while Qwen3-0.6B (q/k norms) went from 1,392.9 to 1,300.9
# tok/s, and to 1,294.1 tok/s with the norm weights read before the wait.
PACKED_DECODE_MAX_ROWS = 16
PACKED_DECODE_WITH_QK_NORM = False


class Attention(nn.Module):
    """Stores this step's keys/values into the cache, then attends each sequence over its context.

    ``k_cache``/``v_cache`` ([num_blocks, block_size, num_kv_heads, head_dim]) are bound by the model
    runner once it has sized the cache.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, KVH, D] → [T, H*D]."""
        if meta.uses_kernels:
            from pocketllm.kernels.attention import store_kv

            store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
            return self._attend_kernels(q.contiguous(), meta)
        k_flat = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k.to(k_flat.dtype))
        v_flat.index_copy_(0, meta.slot_mapping, v.to(v_flat.dtype))
        if meta.is_decode_only:
            out = self._decode(q, meta)
        else:
            out = torch.cat([self._sequence(q, meta, i) for i in range(meta.num_seqs)], dim=0)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def forward_packed(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                       q_norm: nn.Module | None, k_norm: nn.Module | None, meta: AttentionMetadata) -> torch.Tensor:
        """CUDA kernel path from the fused projection ``qkv`` [T, (H + 2 KVH) * D]: per-head q/k norm, rotary
        embedding and the KV store in one launch, then paged attention → [T, H*D]."""
        from pocketllm.kernels.attention import packed_decode_supported, paged_decode_packed
        from pocketllm.kernels.fused import qkv_prepare

        if (meta.is_decode_only and qkv.shape[0] <= PACKED_DECODE_MAX_ROWS
                and (q_norm is None or PACKED_DECODE_WITH_QK_NORM) and packed_decode_supported(self.head_dim)):
            out = paged_decode_packed(
                qkv, positions, rotary.cos_cache, rotary.sin_cache, None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight, q_norm.eps if q_norm is not None else 0.0, self.num_heads,
                self.num_kv_heads, self.head_dim, self.k_cache, self.v_cache, meta.slot_mapping, meta.block_tables,
                meta.context_lens_gpu, self.scale, meta.num_splits, meta.split_counters, block_n=meta.decode_tile)
            return out.view(qkv.shape[0], self.num_heads * self.head_dim)
        q = qkv_prepare(qkv, positions, rotary.cos_cache, rotary.sin_cache,
                        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                        q_norm.eps if q_norm is not None else 0.0, self.num_heads, self.num_kv_heads,
                        self.head_dim, self.k_cache, self.v_cache, meta.slot_mapping)
        return self._attend_kernels(q, meta)

    def _attend_kernels(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        from pocketllm.kernels.attention import paged_decode, paged_prefill

        if meta.is_decode_only:
            out = paged_decode(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens_gpu,
                               self.scale, meta.num_splits, counters=meta.split_counters, block_n=meta.decode_tile)
        else:
            out = torch.empty_like(q)
            lead = meta.num_decode_rows
            if lead:
                paged_decode(q[:lead], self.k_cache, self.v_cache, meta.block_tables[:lead],
                             meta.context_lens_gpu[:lead], self.scale, meta.num_splits, out=out[:lead],
                             counters=meta.split_counters, block_n=meta.decode_tile)
            paged_prefill(q, self.k_cache, self.v_cache, meta.block_tables, meta.context_lens_gpu,
                          meta.query_start_gpu, meta.max_query_len, self.scale, out=out, first_seq=lead)
        return out.view(q.shape[0], self.num_heads * self.head_dim)

    def _context(self, meta: AttentionMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = meta.context_lens[i]
        blocks = meta.block_tables[i, : -(-length // meta.block_size)]
        k = self.k_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        v = self.v_cache[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        return k, v

    def _sequence(self, q: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        k, v = self._context(meta, i)
        q_len, ctx_len = end - start, k.shape[0]
        mask = None
        if q_len > 1:
            rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
            attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads)
        return out.transpose(0, 1)

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence: pad every context to the longest and attend in one call."""
        lens = torch.tensor(meta.context_lens, device=q.device)
        max_len = int(max(meta.context_lens))
        num_blocks = -(-max_len // meta.block_size)
        blocks = meta.block_tables[:, :num_blocks]
        shape = (meta.num_seqs, num_blocks * meta.block_size, self.num_kv_heads, self.head_dim)
        k = self.k_cache[blocks].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
        v = self.v_cache[blocks].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
        mask = (torch.arange(max_len, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out.squeeze(2)
