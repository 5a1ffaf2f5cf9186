"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.kernels import kernels_enabled


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
        if x.is_cuda and kernels_enabled():
            from pocketllm.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class OffsetRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight is stored around zero: ``x / rms(x) * (1 + weight)`` (Qwen3.5, Gemma).

    The offset is added in float32 at run time, so a bfloat16 weight keeps its precision.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
