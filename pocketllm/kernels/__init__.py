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


def optional_import(module: str, switch: str) -> bool:
    """Whether the optional package ``module`` imports and the environment variable ``switch`` (set and not 0)
    does not turn it off; a broken or incompatible install counts as absent, not as a crash."""
    if os.environ.get(switch, "") not in ("", "0"):
        return False
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:
        return False
    return True


@functools.cache
def _triton_importable() -> bool:
    return optional_import("triton", "POCKETLLM_DISABLE_TRITON")


def kernels_enabled() -> bool:
    """Whether CUDA tensors go through the Triton kernels (Triton importable and not switched off)."""
    return _triton_importable()


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels serve tensors on ``device`` (CUDA with Triton installed)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and _triton_importable()
