"""Tensor-parallel group helpers over ``torch.distributed`` (a single rank when it is not initialised)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from pocketllm.errors import EngineDeadError

_single_rank_depth = 0
_joined = False   # set by group.init_group: a process group someone else made does not shard our layers


def set_joined(joined: bool) -> None:
    """Record that this process has joined (True) or left (False) PocketLLM's tensor-parallel group."""
    global _joined
    _joined = joined


def _active() -> bool:
    return _joined and _single_rank_depth == 0 and dist.is_initialized()


def tp_rank() -> int:
    """This process's rank in the tensor-parallel group (0 without distributed)."""
    return dist.get_rank() if _active() else 0


def tp_size() -> int:
    """Number of tensor-parallel ranks (1 without distributed)."""
    return dist.get_world_size() if _active() else 1


@contextmanager
def single_rank() -> Iterator[None]:
    """Layers built inside see one rank (full, unsharded shapes), e.g. a meta-device twin of a sharded model."""
    global _single_rank_depth
    _single_rank_depth += 1
    try:
        yield
    finally:
        _single_rank_depth -= 1


@contextmanager
def lost_rank_is_fatal() -> Iterator[None]:
    """A failed collective (a rank died, the group broke) surfaces as ``EngineDeadError``."""
    try:
        yield
    except RuntimeError as exc:  # gloo and NCCL raise RuntimeError subclasses
        raise EngineDeadError(f"a tensor-parallel rank failed: {exc}") from exc


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel group, in place; a no-op on one rank."""
    if tp_size() > 1:
        with lost_rank_is_fatal():
            dist.all_reduce(x)
    return x


def max_over_ranks_(x: torch.Tensor) -> torch.Tensor:
    """The element-wise maximum of ``x`` over the tensor-parallel group, in place; a no-op on one rank."""
    if tp_size() > 1:
        with lost_rank_is_fatal():
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's ``x`` along the last dimension; identity on one rank."""
    size = tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    with lost_rank_is_fatal():
        dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def min_over_ranks(value: int, device: torch.device) -> int:
    """The smallest ``value`` any rank holds (e.g. KV blocks, so every rank sizes its cache alike)."""
    if tp_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    with lost_rank_is_fatal():
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())
