"""How an attention layer stores a step's keys/values into its paged KV cache and attends: one interface, two
implementations.

``TorchAttentionBackend`` is the PyTorch reference (SDPA over the gathered cache blocks; CPU, and any device
without kernels), with the plain ``AttentionMetadata`` the reference step builds. ``TritonAttentionBackend`` runs
the Triton kernels (CUDA) with the kernel metadata (``context_lens_gpu`` and the rest) the CUDA step builds, and
also takes the fused QKV projection (``forward_packed``: q/k norm, rotary and the KV store in the attention
launches). The model runner binds a layer's backend together with the step backend that builds its metadata
(``runner/model_runner.py``). The Triton kernel modules are imported inside the Triton backend's methods only, so
that everything here imports where Triton is absent (``kernels/fp8.py`` is torch only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.kernels.fp8 import copy_rows_
from pocketllm.step.attention_metadata import AttentionMetadata

# Decode steps of up to this many sequences prepare Q/K/V inside the attention kernel (one launch instead of
# two, and the cached context read while the QKV product finishes); larger batches keep two kernels (at batch
# 256 the packed kernel took 330 µs a layer against 217 µs for the two: it spills registers). Models with
# per-head q/k norms keep the two kernels too (``PACKED_DECODE_WITH_QK_NORM``): measured on an H200 at batch 1,
# Llama-3-8B went from 235.8 to 241.1 tok/s with it, while Qwen3-0.6B (q/k norms) went from 1,392.9 to 1,300.9
# tok/s, and to 1,294.1 tok/s with the norm weights read before the wait.
PACKED_DECODE_MAX_ROWS = 16
PACKED_DECODE_WITH_QK_NORM = False


class AttentionLayer(Protocol):
    """What a backend reads of the layer it runs (``layers/attention.py``'s ``Attention``): its shape, scale,
    window and the paged cache ([num_blocks, block_size, num_kv_heads, head_dim] each)."""

    num_heads: int
    head_dim: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class AttentionBackend(ABC):
    """Stores keys/values into a layer's cache and attends each sequence over its context."""

    name = ""
    # Whether ``forward_packed`` runs: the backend takes the fused QKV projection (full-width rotary only).
    supports_packed = False

    @abstractmethod
    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, KVH, D] → [T, H*D], this step's keys/values stored first."""

    def forward_packed(self, layer: AttentionLayer, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                       q_norm: nn.Module | None, k_norm: nn.Module | None, meta: AttentionMetadata) -> torch.Tensor:
        """From the fused projection ``qkv`` [T, (H + 2 KVH) * D]: per-head q/k norm, rotary embedding, the KV
        store and attention → [T, H*D]; only where ``supports_packed``."""
        raise NotImplementedError(f"the {self.name} attention backend does not take the packed QKV projection")

    def forward_gated(self, layer: AttentionLayer, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                      q_norm: nn.Module, k_norm: nn.Module, meta: AttentionMetadata) -> torch.Tensor:
        """Gated attention (Qwen3.5) from its fused projection ``qkv`` [T, H * 2D + 2 KVH * D] (each q head's D
        query channels, then its D gate channels): per-head q/k norm, rotary embedding, the KV store, attention,
        and the output times ``sigmoid(gate)`` → [T, H*D]. This is the reference; a backend may fuse it."""
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        query_gate, k, v = qkv.split([2 * heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        query_gate = query_gate.view(-1, heads, 2 * dim)
        q, gate = query_gate[..., :dim], query_gate[..., dim:]
        q, k = rotary(positions, q_norm(q), k_norm(k.view(-1, kv_heads, dim)))
        out = self.forward(layer, q, k, v.view(-1, kv_heads, dim), meta)
        return out * torch.sigmoid(gate.reshape(out.shape))


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch reference: ``index_copy_`` into the cache, SDPA over each sequence's gathered blocks. A float8
    cache (``kv_cache_dtype="fp8"``) holds e4m3 codes with scale 1, quantised and widened as the Triton kernels
    do (``kernels/fp8.py``: ``quantize_kv``)."""

    name = "torch"

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        k_flat = layer.k_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        v_flat = layer.v_cache.view(-1, layer.num_kv_heads, layer.head_dim)
        # A float8 cache stores ``quantize_kv``'s codes (scale 1, as the Triton store kernels do); reads below
        # widen every cache dtype to the queries' dtype.
        copy_rows_(k_flat, meta.slot_mapping, k)
        copy_rows_(v_flat, meta.slot_mapping, v)
        if meta.is_decode_only:
            out = self._decode(layer, q, meta)
        else:
            out = torch.cat([self._sequence(layer, q, meta, i) for i in range(meta.num_seqs)], dim=0)
        return out.reshape(q.shape[0], layer.num_heads * layer.head_dim)

    def _context(self, layer: AttentionLayer, meta: AttentionMetadata, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        length = meta.context_lens[i]
        blocks = meta.block_tables[i, : -(-length // meta.block_size)]
        k = layer.k_cache[blocks].reshape(-1, layer.num_kv_heads, layer.head_dim)[:length]
        v = layer.v_cache[blocks].reshape(-1, layer.num_kv_heads, layer.head_dim)[:length]
        return k, v

    def _sequence(self, layer: AttentionLayer, q: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        k, v = self._context(layer, meta, i)
        q_len, ctx_len = end - start, k.shape[0]
        mask = None
        if q_len > 1 or layer.sliding_window is not None:
            rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)[:, None]
            cols = torch.arange(ctx_len, device=q.device)[None, :]
            mask = cols <= rows
            if layer.sliding_window is not None:
                mask = mask & (cols > rows - layer.sliding_window)
        out = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k.transpose(0, 1).to(q.dtype), v.transpose(0, 1).to(q.dtype),
            attn_mask=mask, scale=layer.scale, enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.transpose(0, 1)

    def _decode(self, layer: AttentionLayer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """One query per sequence: pad every context to the longest and attend in one call."""
        lens = torch.tensor(meta.context_lens, device=q.device)
        max_len = int(max(meta.context_lens))
        num_blocks = -(-max_len // meta.block_size)
        blocks = meta.block_tables[:, :num_blocks]
        shape = (meta.num_seqs, num_blocks * meta.block_size, layer.num_kv_heads, layer.head_dim)
        k = layer.k_cache[blocks].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
        v = layer.v_cache[blocks].reshape(shape)[:, :max_len].transpose(1, 2).to(q.dtype)
        cols = torch.arange(max_len, device=q.device)[None, :]
        mask = cols < lens[:, None]
        if layer.sliding_window is not None:
            mask = mask & (cols >= lens[:, None] - layer.sliding_window)
        mask = mask[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=mask, scale=layer.scale,
            enable_gqa=layer.num_heads != layer.num_kv_heads)
        return out.squeeze(2)


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels (``kernels/attention.py``, ``kernels/fused.py``) over the CUDA step's metadata."""

    name = "triton"
    supports_packed = True

    def forward(self, layer: AttentionLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        from pocketllm.kernels.attention import store_kv

        store_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return self.attend(layer, q.contiguous(), meta)

    def forward_packed(self, layer: AttentionLayer, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                       q_norm: nn.Module | None, k_norm: nn.Module | None, meta: AttentionMetadata) -> torch.Tensor:
        """Small decode steps: one packed launch (Q/K/V prepared inside the attention kernel, each row storing its
        own keys/values); else (and for rows that read each other's: ``rows_share_context``) the QKV preparation
        kernel (KV store included), then ``attend``."""
        from pocketllm.kernels.attention import packed_decode_supported, paged_decode_packed
        from pocketllm.kernels.fused import qkv_prepare

        if (meta.is_decode_only and not meta.rows_share_context and qkv.shape[0] <= PACKED_DECODE_MAX_ROWS
                and (q_norm is None or PACKED_DECODE_WITH_QK_NORM) and packed_decode_supported(layer.head_dim)):
            out = paged_decode_packed(
                qkv, positions, rotary.cos_cache, rotary.sin_cache, None if q_norm is None else q_norm.weight,
                None if k_norm is None else k_norm.weight, q_norm.eps if q_norm is not None else 0.0, layer.num_heads,
                layer.num_kv_heads, layer.head_dim, layer.k_cache, layer.v_cache, meta.slot_mapping,
                meta.block_tables, meta.context_lens_gpu, layer.scale, meta.num_splits, meta.split_counters,
                block_n=meta.decode_tile, window=layer.sliding_window)
            return out.view(qkv.shape[0], layer.num_heads * layer.head_dim)
        q = qkv_prepare(qkv, positions, rotary.cos_cache, rotary.sin_cache,
                        None if q_norm is None else q_norm.weight, None if k_norm is None else k_norm.weight,
                        q_norm.eps if q_norm is not None else 0.0, layer.num_heads, layer.num_kv_heads,
                        layer.head_dim, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return self.attend(layer, q, meta)

    def forward_gated(self, layer: AttentionLayer, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                      q_norm: nn.Module, k_norm: nn.Module, meta: AttentionMetadata) -> torch.Tensor:
        """Three launches around the attention: q/k norms, rotary and the KV store in one
        (``gated_qkv_prepare``), the attention, the gate (``sigmoid_gate``)."""
        from pocketllm.kernels.fused import gated_qkv_prepare, sigmoid_gate

        q = gated_qkv_prepare(qkv, positions, rotary.cos_cache, rotary.sin_cache, q_norm.weight, k_norm.weight,
                              q_norm.eps, q_norm.offset, layer.num_heads, layer.num_kv_heads, layer.head_dim,
                              rotary.rotary_dim, layer.k_cache, layer.v_cache, meta.slot_mapping)
        return sigmoid_gate(self.attend(layer, q, meta), qkv, layer.num_heads, layer.head_dim)

    def attend(self, layer: AttentionLayer, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the cache (this step's keys/values already stored): the decode kernel for decode rows
        (a mixed step's leading ones), the prefill kernel for the rest → [T, H*D]."""
        from pocketllm.kernels.attention import paged_decode, paged_prefill

        if meta.is_decode_only:
            out = paged_decode(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens_gpu,
                               layer.scale, meta.num_splits, counters=meta.split_counters, block_n=meta.decode_tile,
                               window=layer.sliding_window)
        else:
            out = torch.empty_like(q)
            lead = meta.num_decode_rows
            if lead:
                paged_decode(q[:lead], layer.k_cache, layer.v_cache, meta.block_tables[:lead],
                             meta.context_lens_gpu[:lead], layer.scale, meta.num_splits, out=out[:lead],
                             counters=meta.split_counters, block_n=meta.decode_tile, window=layer.sliding_window)
            paged_prefill(q, layer.k_cache, layer.v_cache, meta.block_tables, meta.context_lens_gpu,
                          meta.query_start_gpu, meta.max_query_len, layer.scale, out=out, first_seq=lead,
                          window=layer.sliding_window)
        return out.view(q.shape[0], layer.num_heads * layer.head_dim)
