"""Qwen3.5 (dense): a hybrid of Gated DeltaNet (linear attention) and gated full-attention layers.

``config.layer_types`` names each layer's token mixer (typically three ``linear_attention`` layers then one
``full_attention``). Full-attention layers use the paged KV cache; linear-attention layers keep a conv and a
recurrent state per request in the runner's state pool (``layers.gated_delta``).

Differences from the Llama layout: every RMSNorm except the DeltaNet's gated one stores ``weight`` around
zero and scales by ``1 + weight``; ``q_proj`` yields, per head, the query followed by an output gate of the
same width (``attn_out * sigmoid(gate)``); q/k RMSNorm per head; rotary embedding on the first
``partial_rotary_factor`` of each head. The checkpoint's multimodal rotary (``mrope_section``) is
degenerate for text: all three position streams equal the token position, so it is plain rotary here
(image and video inputs are refused before they reach the engine).

Checkpoints: ``Qwen3_5ForCausalLM`` names (``model.layers...``) or the text part of a
``Qwen3_5ForConditionalGeneration`` checkpoint (``model.language_model.layers...``; the vision tower is
skipped). The multi-token-prediction head (``mtp.*``) is loaded only when the model runner adds it
(``add_mtp_head``, speculative ``method="mtp"``), else skipped.

The MTP head (``MultiTokenPredictor``) predicts the token after next: at position ``p`` it takes the embedding
of token ``p + 1`` and the target's hidden state at ``p`` (after the final norm), normalises each, projects
their concatenation (embedding first) from ``2H`` to ``H`` (``fc``), runs one full-attention decoder layer of
the model's own kind (dense or experts) with its own keys and values, and a final norm; its logits come from the
target's LM head, its embedding from the target's table.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.attention import Attention
from pocketllm.layers.gated_delta import GatedDeltaNet
from pocketllm.layers.linear import (
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    normed_projection,
    split_over_ranks,
)
from pocketllm.layers.norm import OffsetRMSNorm
from pocketllm.layers.rotary import RotaryEmbedding, rope_settings
from pocketllm.models.llama import CausalLM, PreNormBlock, head_dim_of
from pocketllm.step.attention_metadata import AttentionMetadata

SKIPPED_PREFIXES = ("model.visual.", "visual.")
MTP_PREFIX = "mtp."
TEXT_PREFIXES = ("model.language_model.", "model.")


def rotary_for(config: Any) -> RotaryEmbedding:
    """The (text-position) rotary embedding of a Qwen3.5 config: ``partial_rotary_factor`` of each head."""
    head_dim = head_dim_of(config)
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    theta, scaling = rope_settings(config)
    return RotaryEmbedding(head_dim, int(head_dim * factor), config.max_position_embeddings, theta, scaling)


class GatedAttention(nn.Module):
    """Full attention with per-head q/k norms, partial rotary and a sigmoid output gate from ``q_proj``."""

    def __init__(self, config: Any, rotary: RotaryEmbedding) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        # The "q" part holds, per head, head_dim query rows then head_dim gate rows (a rank keeps whole heads).
        split_over_ranks(config.num_attention_heads, "num_attention_heads")
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, 2 * config.num_attention_heads,
                                          config.num_key_value_heads, bias=bias, prologue="rms_norm")
        self.num_heads = self.qkv_proj.num_heads // 2
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(head_dim, config.rms_norm_eps)
        self.rotary_emb = rotary
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_projected(positions, self.qkv_proj(hidden), meta)

    def forward_projected(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention after its input projection ``qkv`` (which a decoder layer may compute with its norm
        fused)."""
        return self.o_proj(self.attn.forward_gated(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm, meta))


class HybridDecoderLayer(PreNormBlock):
    """Pre-norm token mixer (``linear_attn`` or ``self_attn``) and feed-forward, residual through the norms."""

    def __init__(self, config: Any, layer_type: str, mlp: nn.Module, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.layer_type = layer_type
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(config)
        elif layer_type == "full_attention":
            self.self_attn = GatedAttention(config, rotary)
        else:
            raise ValueError(f"unknown Qwen3.5 layer type {layer_type!r}")
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = OffsetRMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.layer_type == "linear_attention":
            return self.linear_attn(hidden, meta)
        return self.self_attn(positions, hidden, meta)

    def mix_normed(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The input norm handed to the mixer's first projection (one kernel where measured faster)."""
        if self.layer_type == "linear_attention":
            proj, residual = normed_projection(self.linear_attn.in_proj, hidden, residual, self.input_layernorm)
            return self.linear_attn.forward_projected(proj, meta), residual
        qkv, residual = normed_projection(self.self_attn.qkv_proj, hidden, residual, self.input_layernorm)
        return self.self_attn.forward_projected(positions, qkv, meta), residual


class MultiTokenPredictor(nn.Module):
    """The checkpoint's MTP head (``mtp.*``): ``fc`` over the normed embedding and target hidden state, one
    decoder ``layers[0]``, a final ``norm``. ``forward`` returns its hidden states after that norm (what the LM
    head scores, and what the next chained step takes as its hidden state)."""

    def __init__(self, config: Any, layer: nn.Module) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, config.rms_norm_eps)
        self.fc = ReplicatedLinear(2 * hidden, hidden)
        self.layers = nn.ModuleList([layer])
        self.norm = OffsetRMSNorm(hidden, config.rms_norm_eps)

    def forward(self, embedded: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """``embedded`` [T, H]: the embeddings of the tokens after ``positions``; ``target_hidden`` [T, H]: the
        hidden states (after a final norm) at ``positions``."""
        joined = torch.cat([self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(target_hidden)], dim=-1)
        hidden, residual = self.layers[0](positions, self.fc(joined), None, meta)
        normed, _ = self.norm(hidden, residual)
        return normed


def mtp_layer_count(config: Any) -> int:
    """The MTP layers a Qwen3.5 config declares (``mtp_num_hidden_layers``; 0 when it declares none)."""
    return int(getattr(config, "mtp_num_hidden_layers", 0) or 0)


class Qwen3_5ForCausalLM(CausalLM):
    """The shared decoder stack with hybrid layers and offset RMSNorms (the model runner's model interface)."""

    norm_class = OffsetRMSNorm
    supports_mtp = True     # the checkpoint may carry an MTP head (``add_mtp_head``)
    packed_modules = {
        **CausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", "qkv"), "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"), "in_proj_a": ("in_proj", "a"),
    }

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.mtp: MultiTokenPredictor | None = None
        # With the MTP head: the target's hidden states (after the final norm) of every row of the last forward.
        self.mtp_target_hidden: torch.Tensor | None = None

    def make_layer(self, config: Any, layer_index: int) -> nn.Module:
        if getattr(self, "rotary_emb", None) is None:
            self.rotary_emb = rotary_for(config)     # one table shared by every full-attention layer
        layer_type = list(config.layer_types)[layer_index]
        return HybridDecoderLayer(config, layer_type, self.make_mlp(config, layer_index), self.rotary_emb)

    def add_mtp_head(self) -> None:
        """Build the MTP head (``self.mtp``) for speculative ``method="mtp"``, under the caller's device and dtype;
        refused for a config without one MTP layer."""
        config = self.config
        layers = mtp_layer_count(config)
        if layers != 1:
            what = "declares no MTP layer (mtp_num_hidden_layers 0)" if layers == 0 else f"declares {layers}"
            raise UnsupportedFeatureError(f"speculative_config.method 'mtp' needs a checkpoint with one MTP layer; "
                                          f"this one {what}")
        if getattr(config, "mtp_use_dedicated_embeddings", False):
            raise UnsupportedFeatureError("speculative_config.method 'mtp': an MTP head with embeddings of its own "
                                          "(mtp_use_dedicated_embeddings) is not supported")
        layer = HybridDecoderLayer(config, "full_attention", self.make_mlp(config, config.num_hidden_layers),
                                   self.rotary_emb)
        self.mtp = MultiTokenPredictor(config, layer)

    def unnormed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = super().unnormed(input_ids, positions, meta)
        if self.mtp is not None:
            # A new tensor (the step's own final norm may fuse the add in place).
            self.mtp_target_hidden = self.norm(hidden + residual)
        return hidden, residual

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """The MTP head's hidden states (after its norm) at ``positions``, of ``input_ids`` (the tokens after
        them) and the target's (or the head's own) hidden states there."""
        return self.mtp(self.embed_tokens(input_ids), positions, target_hidden, meta)

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint entry (before packing); None for parts we do not run."""
        if name.startswith(SKIPPED_PREFIXES) or (name.startswith(MTP_PREFIX) and self.mtp is None):
            return None
        for prefix in () if name.startswith(MTP_PREFIX) else TEXT_PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        # Experts stored stacked (one tensor per layer) rather than one per expert.
        if name.endswith(".mlp.experts.gate_up_proj"):
            return name.removesuffix("gate_up_proj") + "w13"
        if name.endswith(".mlp.experts.down_proj"):
            return name.removesuffix("down_proj") + "w2"
        return name
