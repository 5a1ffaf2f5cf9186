"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.kernels import kernels_enabled


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for an input holding [gate, up] along the last dimension."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and kernels_enabled():
            from pocketllm.kernels.fused import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
