"""Attention over the paged KV cache: the layer holds its cache and its backend (``attention_backend.py``: the
PyTorch reference or the Triton kernels) and hands every step to it."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.layers.attention_backend import AttentionBackend, TorchAttentionBackend
from pocketllm.step.attention_metadata import AttentionMetadata


class Attention(nn.Module):
    """Stores this step's keys/values into the cache, then attends each sequence over its context.

    ``k_cache``/``v_cache`` ([num_blocks, block_size, num_kv_heads, head_dim]) are bound by the model
    runner once it has sized the cache; ``backend`` is the PyTorch reference until the model runner binds the
    one its step backend's metadata is built for. ``sliding_window`` (None: full attention) lets the query at
    position ``p`` attend only the keys at positions ``p - sliding_window + 1 .. p``.
    """

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.sliding_window = sliding_window
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``q`` [T, H, D], ``k``/``v`` [T, KVH, D] → [T, H*D]."""
        return self.backend.forward(self, q, k, v, meta)

    def forward_packed(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module,
                       q_norm: nn.Module | None, k_norm: nn.Module | None, meta: AttentionMetadata) -> torch.Tensor:
        """From the fused projection ``qkv`` [T, (H + 2 KVH) * D]: per-head q/k norm, rotary embedding, the KV
        store and paged attention → [T, H*D]; only where ``backend.supports_packed``."""
        return self.backend.forward_packed(self, qkv, positions, rotary, q_norm, k_norm, meta)

    def forward_gated(self, qkv: torch.Tensor, positions: torch.Tensor, rotary: nn.Module, q_norm: nn.Module,
                      k_norm: nn.Module, meta: AttentionMetadata) -> torch.Tensor:
        """Gated attention (Qwen3.5) from its fused projection: ``AttentionBackend.forward_gated``."""
        return self.backend.forward_gated(self, qkv, positions, rotary, q_norm, k_norm, meta)
