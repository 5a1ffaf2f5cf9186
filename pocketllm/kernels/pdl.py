"""Programmatic dependent launch (Hopper and later): a kernel launched as a dependent of the one before it on
the stream starts while earlier kernels still run, and waits on them (``gdc_wait``) only before reading their
output. In a decode step of a few hundred short kernels this hides most of each launch gap.

Kernels take a ``PDL`` constexpr: when true they call ``gdc_launch_dependents`` as they start, so the next
kernel can launch and read what no kernel of the step writes (weights, the step's metadata, cached K/V of
earlier steps) while this one and the ones before it still run, and ``gdc_wait`` before their first read of
anything an earlier kernel of the step writes (the decode kernels replace, after it, the new token's K/V row
of a tile they read early); nothing is written before the wait. The wait returns once the kernel just before
has completed, which it does only after its own wait, so every earlier kernel is done then. That holds as
long as at least one program of every such kernel reaches its wait (the decode kernels' first split always
does).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: no programmatic dependent launch
    gdc_launch_dependents = gdc_wait = None

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options"]


@functools.cache
def _enabled(device_index: int) -> bool:
    if gdc_wait is None or os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get("POCKETLLM_PDL") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Dependent launches pay at small batch, where a step is mostly launch gaps; on the 256-request throughput
# workload they measured slower (20.4k and 22.3k against 23.6k output tok/s on an H200), so larger batches
# launch plainly.
MAX_ROWS = 16


def launch_options(tensor: torch.Tensor, rows: int = 1) -> tuple[bool, dict[str, bool]]:
    """(the kernel's ``PDL`` constexpr, extra launch arguments) for a kernel working on ``tensor``'s device
    over ``rows`` rows (tokens or sequences); ``POCKETLLM_PDL=0`` turns dependent launches off."""
    if not tensor.is_cuda or rows > MAX_ROWS:
        return False, {}
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    pdl = _enabled(index)
    return pdl, ({"launch_pdl": True} if pdl else {})
