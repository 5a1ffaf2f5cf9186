"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32; with ``residual`` returns (normed, x + residual)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * self.weight.float()).to(dtype) if dtype != torch.float32 else x * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
