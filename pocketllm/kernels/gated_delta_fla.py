"""The optional ``fla`` backend (the ``fla-core`` package, extra ``pocketllm[fla]``) for Gated DeltaNet prefill.

fla's chunked Triton kernels run every sequence of a varlen batch in one call, each from its own initial state.
Used on CUDA only, and only when ``fla`` imports; ``POCKETLLM_DISABLE_FLA=1`` switches it off. Nothing imports
fla at module import time.

Conventions relied on (fla-core 0.6): inputs ``[1, T, heads, dim]`` with ``cu_seqlens`` for varlen; value head
``h`` reads key head ``h // (value_heads / key_heads)``; ``g`` is the natural-log decay; with
``use_qk_l2norm_in_kernel`` q and k are normalised as ``x / sqrt(sum(x^2) + 1e-6)`` (float32) before ``scale``
multiplies q; states are float32 ``[N, value_heads, key_dim, value_dim]``.
"""

from __future__ import annotations

import functools

import torch

from pocketllm.kernels import optional_import


@functools.cache
def fla_available() -> bool:
    """Whether ``fla``'s gated delta rule imports (and is not switched off by ``POCKETLLM_DISABLE_FLA``)."""
    return optional_import("fla.ops.gated_delta_rule", "POCKETLLM_DISABLE_FLA")


def fla_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor, cu_seqlens: torch.Tensor, cu_seqlens_host: list[int],
                      scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a flat batch of sequences.

    ``q``/``k`` [T, Hk, Dk] raw (after conv and SiLU; normalised in the kernel), ``v`` [T, Hv, Dv], ``g``/``beta``
    [T, Hv] float32, ``initial_state`` [N, Hv, Dk, Dv] float32, ``cu_seqlens`` [N + 1] on the device (with its
    host copy, so that fla needs no device read). Returns (out [T, Hv, Dv] in ``v``'s dtype, final states).
    """
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0), scale=scale,
        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu_seqlens.long(), cu_seqlens_cpu=torch.tensor(cu_seqlens_host, dtype=torch.long))
    return out[0], final


def fla_recurrent_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       initial_state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's fused recurrent kernel for one token per sequence (benchmark comparison with our decode kernel):
    ``q``/``k`` [B, Hk, Dk] raw, ``v`` [B, Hv, Dv], ``g``/``beta`` [B, Hv], ``initial_state`` [B, Hv, Dk, Dv]."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, final = fused_recurrent_gated_delta_rule(
        q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1), beta=beta.unsqueeze(1), scale=scale,
        initial_state=initial_state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    return out[:, 0], final
