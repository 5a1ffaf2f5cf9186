"""Triton kernels for the CUDA path, each with a PyTorch reference in the layer it replaces.

Nothing here imports Triton at module import time: ``available()`` says whether the kernels can run on a
device, and the kernel modules (``attention``, ``fused``) are imported only after it said yes. The CPU path
never touches them.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _triton_importable() -> bool:
    if os.environ.get("POCKETLLM_DISABLE_TRITON", "") not in ("", "0"):
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install means "no kernels", not a crash
        return False
    return True


def kernels_enabled() -> bool:
    """Whether CUDA tensors go through the Triton kernels (Triton importable and not switched off)."""
    return _triton_importable()


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels serve tensors on ``device`` (CUDA with Triton installed)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and _triton_importable()
