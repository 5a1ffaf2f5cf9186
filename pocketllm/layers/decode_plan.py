"""What a model hands a decode fast path: every layer of a decode step described in public terms.

A model whose layers a flat decode step can compute exports a ``DecodePlan`` (``decode_plan()``, the
``ExportsDecodePlan`` protocol); a model it cannot describe returns None, and its steps run through the model's
own forward. The plan holds the model's tensors and products themselves (no copies), so it is built once, after
the weights are in their final format (``quantized_linear.convert_model``), and stays valid as long as the model
does; the KV caches it reaches through ``AttentionPlan.cache`` are bound later by the model runner.

Each layer is the pre-norm Llama decoder layer::

    h = x + o_proj(attention(rotary(q_norm(q), k_norm(k)), v))   where q, k, v = qkv(input_norm(x))
    out = h + down(silu(gate) * up)                              where gate, up = gate_up(post_attention_norm(h))

and the step ends with ``final_norm`` of the last layer's output. The executor (``runner/cpu_decode.py``) checks
what it can run of a plan (every layer the same attention shape, say) and falls back to the model otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from pocketllm.layers.attention import Attention


@dataclass(frozen=True)
class NormPlan:
    """A plain RMSNorm: ``x / rms(x) * weight`` with ``eps`` inside the root."""

    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class ProductPlan:
    """One linear product ``x @ W.T (+ bias)`` of a few rows (a decode step's rows).

    ``run`` computes it for a 2-D ``x`` of any float dtype and returns ``out_dtype``. ``q4_records`` are the
    weights as ``pocketllm.kernels.cpu_native``'s 4-bit records when ``run`` is exactly their product plus
    ``bias`` (else None); ``bias`` is the bias ``run`` adds (None: none).
    """

    run: Callable[[torch.Tensor], torch.Tensor]
    out_dtype: torch.dtype
    bias: torch.Tensor | None = None
    q4_records: torch.Tensor | None = None


@dataclass(frozen=True)
class RotaryPlan:
    """Rotary embedding over the whole head (rotate-half layout): ``x * cos[pos] + rotate_half(x) * sin[pos]``.

    Two plans are equal when their settings are (``head_dim``, ``base``, ``scaling``, ``max_position``); the
    tables ``cos``/``sin`` ([max_position, head_dim], float32) follow from those.
    """

    head_dim: int
    base: float
    scaling: dict[str, Any] | None
    max_position: int
    cos: torch.Tensor = field(compare=False, repr=False)
    sin: torch.Tensor = field(compare=False, repr=False)


@dataclass(frozen=True)
class AttentionPlan:
    """Self-attention over the paged KV cache: ``num_heads`` query heads in groups over ``num_kv_heads``,
    optional per-head RMSNorms of queries and keys (before rotary), softmax scale ``scale``. ``cache`` holds
    ``k_cache``/``v_cache`` ([blocks, block size, KV heads, head dim]) once the model runner binds them.
    ``sliding_window`` (None: full attention): the query at position ``p`` attends the keys at positions
    ``p - sliding_window + 1 .. p`` only."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rotary: RotaryPlan
    q_norm: NormPlan | None
    k_norm: NormPlan | None
    cache: Attention = field(compare=False, repr=False)
    sliding_window: int | None = None

    @property
    def shape(self) -> tuple[int, int, int, float, RotaryPlan, bool]:
        """What layers must share to run in one flat step: heads, KV heads, head size, scale, rotary, q/k norms."""
        return self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.rotary, self.q_norm is not None


@dataclass(frozen=True)
class LayerPlan:
    """One pre-norm decoder layer: norm, fused QKV product, attention, output product, norm, SwiGLU MLP
    (``gate_up`` yields [gate | up], halves of its output)."""

    input_norm: NormPlan
    qkv: ProductPlan
    attention: AttentionPlan
    o_proj: ProductPlan
    post_attention_norm: NormPlan
    gate_up: ProductPlan
    down: ProductPlan


@dataclass(frozen=True)
class DecodePlan:
    """A decoder's decode step: the token embedding table, the layers in order and the final norm."""

    embedding: torch.Tensor
    layers: tuple[LayerPlan, ...]
    final_norm: NormPlan


@runtime_checkable
class ExportsDecodePlan(Protocol):
    """A model that may describe itself as a ``DecodePlan``."""

    def decode_plan(self) -> DecodePlan | None:
        """The model's decode step as a plan, or None where its layers are not ones the plan describes."""
        ...


def decode_plan_of(model: object) -> DecodePlan | None:
    """``model``'s plan, or None when it exports none."""
    return model.decode_plan() if isinstance(model, ExportsDecodePlan) else None
