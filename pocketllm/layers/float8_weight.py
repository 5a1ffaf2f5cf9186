"""The float8 state a layer with a ``weight`` [N, K] takes on under ``quantization="fp8"``."""

from __future__ import annotations

import torch


class Float8Weight:
    """Mixed into a module with a ``weight`` parameter: ``quantize_fp8`` re-holds it as float8 e4m3 codes with
    one float32 scale per row (``kernels/fp8.py``)."""

    # The codes' per-row scales (None: the weight is in the compute dtype) and that dtype once quantised.
    weight_scale: torch.Tensor | None = None
    compute_dtype: torch.dtype | None = None

    def fp8_row_amax(self) -> torch.Tensor | None:
        """Each row's largest magnitude where the weight holds only part of every row (None: its own rows')."""
        return None

    def quantize_fp8(self) -> None:
        """Hold the weight as float8 e4m3 codes with one scale per row. A parameter the weight shared (a tied
        embedding) keeps its values."""
        from pocketllm.kernels.fp8 import quantize_parameter

        amax = self.fp8_row_amax()
        self.compute_dtype = self.weight.dtype
        self.weight, self.weight_scale = quantize_parameter(self.weight, amax)
