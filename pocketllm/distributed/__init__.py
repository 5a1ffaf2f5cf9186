"""Tensor-parallel group helpers over ``torch.distributed`` (a single rank when it is not initialised)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    """This process's rank in the tensor-parallel group (0 without distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    """Number of tensor-parallel ranks (1 without distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place; a no-op on one rank."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension; identity on one rank."""
    size = tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
