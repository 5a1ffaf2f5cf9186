"""Gemma 3 (text): interleaved sliding-window and full attention over the shared decoder stack.

Differences from the Llama layout, as transformers' ``Gemma3ForCausalLM`` computes them: every RMSNorm (the
q/k norms included) scales by ``1 + weight``; four norms a layer (input, post-attention, pre-feedforward,
post-feedforward), the attention and feed-forward outputs normed before they join the residual stream; a GeGLU
feed-forward (tanh-approximated GELU); embeddings scaled by ``sqrt(hidden_size)`` rounded to the embedding dtype;
attention scaled by ``query_pre_attn_scalar ** -0.5``; sliding layers (``layer_types``) with their own rotary
base; final logits soft-capped by ``final_logit_softcapping`` where set.

Checkpoints: ``Gemma3ForCausalLM`` names (``model.layers...``) or the text part of a
``Gemma3ForConditionalGeneration`` checkpoint (``model.language_model...`` or ``language_model.model...``; the
vision tower and the multimodal projector are skipped).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.activation import gelu_tanh_and_mul
from pocketllm.layers.attention import Attention
from pocketllm.layers.decode_plan import DecodePlan
from pocketllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pocketllm.layers.norm import OffsetRMSNorm
from pocketllm.layers.rotary import RotaryEmbedding
from pocketllm.models.llama import CausalLM, PreNormBlock, head_dim_of
from pocketllm.models.windows import FULL, SLIDING, every_named_layer
from pocketllm.step.attention_metadata import AttentionMetadata

SKIPPED_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                    "multi_modal_projector.")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# transformers' Gemma 3 defaults for the two rotary bases (full layers, sliding layers).
DEFAULT_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
_LEGACY_THETA = {FULL: "rope_theta", SLIDING: "rope_local_base_freq"}


def check_supported(config: Any) -> None:
    """Refuse, by name, a config feature this model does not compute."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedFeatureError("attn_logit_softcapping is not supported for Gemma 3")
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedFeatureError("use_bidirectional_attention is not supported for Gemma 3")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "gelu_pytorch_tanh")
    if activation not in GELU_TANH:
        raise UnsupportedFeatureError(f"hidden_activation {activation!r} is not supported for Gemma 3 "
                                      f"(only {', '.join(GELU_TANH)})")


def rope_for(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) of one layer type: transformers 5's ``rope_parameters[layer_type]``, else the
    ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` entries."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type)
    if params is None:
        theta = getattr(config, _LEGACY_THETA[layer_type], None) or DEFAULT_THETA[layer_type]
        scaling = getattr(config, "rope_scaling", None) if layer_type == FULL else None
        params = {"rope_theta": theta, **(scaling or {})}
    theta = float(params.get("rope_theta", DEFAULT_THETA[layer_type]))
    kind = params.get("rope_type", params.get("type", "default"))
    return theta, None if kind == "default" else dict(params)


class GeGLU(nn.Module):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3Attention(nn.Module):
    """QKV projection, per-head (1 + w) q/k norms, rotary, paged attention (through the layer's attention
    backend) scaled by ``query_pre_attn_scalar ** -0.5``, output projection."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary
        scale = float(config.query_pre_attn_scalar) ** -0.5
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, scale, sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), meta))


class Gemma3DecoderLayer(PreNormBlock):
    """Attention and GeGLU, each between a pre-norm and a post-norm, the residual carried through the norms."""

    def __init__(self, config: Any, rotary: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = Gemma3Attention(config, rotary, sliding_window)
        self.mlp = GeGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = OffsetRMSNorm(config.hidden_size, eps)

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.self_attn(positions, hidden, meta)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.mix_normed(positions, hidden, residual, meta)
        hidden, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(hidden), residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(CausalLM):
    """The shared decoder stack with Gemma 3 layers, a scaled embedding and soft-capped logits."""

    norm_class = OffsetRMSNorm

    def __init__(self, config: Any) -> None:
        check_supported(config)
        self.rotary_tables: dict[str, RotaryEmbedding] = {}
        super().__init__(config)
        self.embed_scale = float(config.hidden_size) ** 0.5
        cap = getattr(config, "final_logit_softcapping", None)
        self.final_logit_softcapping = float(cap) if cap is not None else None

    def layer_windows(self, config: Any) -> list[int | None]:
        return every_named_layer(config)

    def make_layer(self, config: Any, layer_index: int) -> nn.Module:
        layer_type = list(config.layer_types)[layer_index]
        if layer_type not in self.rotary_tables:   # one table per layer type, shared by its layers
            head_dim = head_dim_of(config)
            theta, scaling = rope_for(config, layer_type)
            self.rotary_tables[layer_type] = RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings,
                                                             theta, scaling)
        table = self.rotary_tables[layer_type]
        return Gemma3DecoderLayer(config, table, self.sliding_windows[layer_index])

    def decode_plan(self) -> DecodePlan | None:
        """None: the CPU decode plan describes neither the scaled embedding, the (1 + w) norms nor the
        post-norms, so Gemma 3 runs the reference path there."""
        return None

    def unnormed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream), the embedding scaled as transformers scales it."""
        hidden = self.embed_tokens(input_ids)
        # transformers multiplies by sqrt(hidden_size) rounded to the embedding's dtype.
        hidden = hidden * torch.tensor(self.embed_scale, dtype=hidden.dtype).item()
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return hidden, residual

    def _soft_cap(self, logits: torch.Tensor) -> torch.Tensor:
        """``cap * tanh(logits / cap)`` in place where ``final_logit_softcapping`` is set."""
        cap = self.final_logit_softcapping
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._soft_cap(self.lm_head(hidden))

    def logits_unnormed(self, hidden: torch.Tensor, residual: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        return self._soft_cap(self.lm_head.forward_normed(hidden, residual, self.norm, out))

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint entry (before packing); None for the vision parts."""
        if name.startswith(SKIPPED_PREFIXES):
            return None
        if name.startswith(("language_model.lm_head.", "lm_head.")):
            return name.removeprefix("language_model.")
        for prefix in TEXT_PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):]
        return name
