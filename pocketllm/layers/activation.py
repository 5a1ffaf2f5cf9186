"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.kernels import kernels_enabled


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for an input holding [gate, up] along the last dimension."""
    if x.is_cuda and kernels_enabled():
        from pocketllm.kernels.fused import silu_and_mul as fused_silu_and_mul

        return fused_silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    """``silu_and_mul`` as a module."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (GeGLU with the tanh approximation) for an input holding [gate, up]."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
