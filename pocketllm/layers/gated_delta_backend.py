"""Which implementation runs the Gated DeltaNet rule: the rule, in one place.

Decode (one token per sequence, the CUDA kernel path): our Triton step (``kernels/gated_delta.py``: conv update,
SiLU, L2 norms, delta rule and gated RMSNorm in two launches, CUDA-graph safe) whenever Triton serves the
device; else the PyTorch reference.

Prefill (any batch with a sequence of more than one new token), for a model in bf16/fp16 on CUDA: fla's chunked
kernels (``kernels/gated_delta_fla.py``) when the optional ``fla`` imports, else our Triton chunked rule
(``kernels/gated_delta_prefill.py``); each runs the whole batch in one launch. Otherwise the PyTorch chunked
reference, one sequence at a time. float32 models stay on the reference because fla's float32 matmuls may run
in TF32, and the float32 CUDA path is held to the CPU path's tokens.

``POCKETLLM_GDN_DECODE`` (``auto`` | ``triton`` | ``torch``) and ``POCKETLLM_GDN_PREFILL`` (``auto`` | ``fla`` |
``triton`` | ``torch``) override the choice for measurements; a backend that cannot run is never chosen.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import torch

from pocketllm.kernels import available as kernels_available
from pocketllm.step.attention_metadata import AttentionMetadata


class GatedDeltaBackend(NamedTuple):
    decode: str   # "triton" | "torch"
    prefill: str  # "fla" | "triton" | "torch"


def _override(name: str) -> str:
    return os.environ.get(name, "auto").strip().lower() or "auto"


@functools.cache
def _choose(device: torch.device, dtype: torch.dtype, uses_kernels: bool) -> GatedDeltaBackend:
    on_cuda = device.type == "cuda"
    triton_ok = on_cuda and uses_kernels and kernels_available(device)
    decode = "triton" if triton_ok and _override("POCKETLLM_GDN_DECODE") != "torch" else "torch"
    wanted = _override("POCKETLLM_GDN_PREFILL")
    half = dtype in (torch.bfloat16, torch.float16)
    prefill = "torch"
    if on_cuda and wanted in ("auto", "fla"):
        from pocketllm.kernels.gated_delta_fla import fla_available

        if fla_available() and (wanted == "fla" or half):
            prefill = "fla"
    if prefill == "torch" and triton_ok and (wanted == "triton" or (wanted == "auto" and half)):
        prefill = "triton"
    return GatedDeltaBackend(decode, prefill)


def gated_delta_backend(hidden: torch.Tensor, meta: AttentionMetadata) -> GatedDeltaBackend:
    """The backends for this forward pass (decode only matters when every sequence brings one token)."""
    choice = _choose(hidden.device, hidden.dtype, meta.uses_kernels)
    if not meta.is_decode_only and choice.decode != "torch":
        choice = choice._replace(decode="torch")
    return choice


def decode_runs_chains(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps on the kernel path run the Triton step, which also runs rows in state chains
    (``AttentionMetadata.state_chain``: a verify chunk's positions as decode rows of a CUDA graph)."""
    return _choose(device, dtype, True).decode == "triton"
