"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from pocketllm.kernels import kernels_enabled
from pocketllm.layers.decode_plan import NormPlan


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, computed in float32; with ``residual`` returns (normed, x + residual)."""

    offset = False  # True: the weight is stored around zero and scales by ``1 + weight``

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        initial = torch.zeros(hidden_size) if self.offset else torch.ones(hidden_size)
        self.weight = nn.Parameter(initial, requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return (normed * self.weight.float()).to(dtype) if dtype != torch.float32 else normed * self.weight

    def decode_plan(self) -> NormPlan | None:
        """This norm as a decode plan's plain RMSNorm (None for the zero-centred ``1 + weight`` form)."""
        return None if self.offset else NormPlan(self.weight, self.eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.is_cuda and kernels_enabled():
            from pocketllm.kernels.fused import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, self.offset)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class OffsetRMSNorm(RMSNorm):
    """RMSNorm whose checkpoint weight is stored around zero: ``x / rms(x) * (1 + weight)`` (Qwen3.5, Gemma).

    The offset is added in float32 at run time, so a bfloat16 weight keeps its precision.
    """

    offset = True
