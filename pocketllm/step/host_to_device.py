"""Small host-to-device tensors that never make the host wait for the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.tensor(values)`` on ``device``. On CUDA the values go through pinned memory with a non-blocking
    copy: a plain copy from pageable memory synchronises the stream, so while a launched step still runs it
    would wait for that step (and undo the overlap of host and device work)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
