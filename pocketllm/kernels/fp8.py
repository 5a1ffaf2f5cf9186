"""Float8 (e4m3) weights with one scale per output row: quantisation and the many-row product (torch ops only).

A weight ``W`` [N, K] is held as ``codes`` (float8_e4m3fn) and ``scale`` [N] (float32) with ``W ≈ codes *
scale[:, None]``; each row's largest magnitude maps to 448, e4m3's largest finite value. A few rows of
activations go through the skinny Triton kernels (``gemv``), which widen the codes as they load them. More
rows go through ``scaled_product``: on a GPU with float8 tensor cores (compute capability 8.9 and later) the
activations are quantised per row to float8 and multiplied by cuBLAS's scaled product; elsewhere (CPU, older
GPUs) the codes are widened to the activations' dtype first, which gives the same values with more traffic.

A float8 KV cache (``kv_cache_dtype="fp8"``) has no scale at all: ``quantize_kv`` is the conversion the Triton
store kernels make (``kernels/attention.py``, ``kernels/fused.py``), which the PyTorch reference attention makes
too, so that CPU measures the quality the GPU gives.
"""

from __future__ import annotations

import functools

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_weight(weight: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of ``weight`` [N, K]: one float32 scale per row (its largest magnitude over 448; an
    all-zero row gets scale 1). ``amax``: each row's largest magnitude, where the row is wider than ``weight``
    (split over tensor-parallel ranks); default ``weight``'s own."""
    w = weight.float()
    amax = w.abs().amax(dim=1) if amax is None else amax.float()
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return codes, scale


def quantize_parameter(weight: torch.Tensor, amax: torch.Tensor | None = None
                       ) -> tuple[torch.nn.Parameter, torch.Tensor]:
    """``quantize_weight`` of ``weight``, its codes as a frozen parameter (a layer's new weight)."""
    codes, scale = quantize_weight(weight.data, amax)
    return torch.nn.Parameter(codes, requires_grad=False), scale


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``codes * scale[:, None]`` in ``dtype``."""
    return (codes.float() * scale[:, None]).to(dtype)


@functools.cache
def _has_scaled_mm(device: torch.device) -> bool:
    """Whether cuBLAS's float8 product with per-row scales runs on ``device`` (CUDA, capability 8.9 or later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9) and hasattr(
        torch, "_scaled_mm")


def uses_scaled_mm(x: torch.Tensor, codes: torch.Tensor) -> bool:
    """Whether ``scaled_product`` runs on the float8 tensor cores for these operands (cuBLAS needs both of the
    weight's dimensions to be multiples of 16)."""
    n, k = codes.shape
    return x.is_cuda and x.dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0 and _has_scaled_mm(x.device)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(codes, scale)`` of activations ``x`` [M, K] with one scale per row ([M, 1], float32)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def scaled_product(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (codes * scale[:, None]).T + bias`` in ``x``'s dtype, for ``x`` [..., K]."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.shape[0] and uses_scaled_mm(x2, codes):
        xq, x_scale = quantize_rows(x2)
        out = torch._scaled_mm(xq, codes.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype)
    else:
        out = torch.nn.functional.linear(x2, codes.to(x.dtype)) * scale.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*shape[:-1], codes.shape[0])


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """Keys or values as a float8 KV cache holds them: e4m3 codes with scale 1 (no per-tensor, per-head or
    per-token scale), rounded to nearest even from float32, magnitudes beyond 448 saturating to +-448 (NaN
    stays NaN). The Triton store kernels convert the same way (through float32, a saturating conversion); reading
    the cache widens the codes to the queries' dtype, which holds every e4m3 value exactly."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def copy_rows_(cache: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> None:
    """``cache.index_copy_(0, index, rows)`` with ``rows`` converted to the cache's dtype (``quantize_kv`` for a
    float8 cache, whose codes are then copied as bytes: torch has no float8 ``index_copy_`` on CPU)."""
    if cache.dtype == FP8:
        codes = rows if rows.dtype == FP8 else quantize_kv(rows)
        cache.view(torch.uint8).index_copy_(0, index, codes.view(torch.uint8))
    else:
        cache.index_copy_(0, index, rows if rows.dtype == cache.dtype else rows.to(cache.dtype))
