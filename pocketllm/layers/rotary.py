"""Rotary position embeddings (NeoX/HF rotate-half layout), with Llama-3 frequency scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pocketllm.layers.decode_plan import RotaryPlan


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Scale long wavelengths down by ``factor`` and blend the band between, as Llama 3.1 does."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


def _linear_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


_SCALERS = {"llama3": _llama3_inv_freq, "linear": _linear_inv_freq}


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from a config, whether it spells them the transformers 4 or 5 way."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    scaling = getattr(hf_config, "rope_scaling", None) or None
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(theta), scaling


class RotaryEmbedding(nn.Module):
    """Applies rotary embeddings to the first ``rotary_dim`` channels of each head."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim
        self.base = base
        self.scaling = scaling
        self.max_position = max_position
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in _SCALERS:
                raise ValueError(f"rope scaling type {kind!r} is not supported")
            inv_freq = _SCALERS[kind](inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def decode_plan(self) -> RotaryPlan | None:
        """This embedding as a decode plan's rotary (None when it rotates only part of each head)."""
        if self.rotary_dim != self.head_dim:
            return None
        return RotaryPlan(self.head_dim, self.base, self.scaling, self.max_position, self.cos_cache, self.sin_cache)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_dim:
            return (x * cos + self._rotate_half(x) * sin).to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        return torch.cat(((rot * cos + self._rotate_half(rot) * sin).to(x.dtype), rest), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """``q``/``k`` are [tokens, heads, head_dim]; returns them rotated."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
