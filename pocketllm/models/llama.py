"""Llama-family decoder (Llama 2/3, SmolLM2), parameterised for its Qwen2/Qwen3 relatives."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.distributed import tp_size
from pocketllm.layers.attention import Attention
from pocketllm.layers.decode_plan import AttentionPlan, DecodePlan, LayerPlan, NormPlan, ProductPlan
from pocketllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pocketllm.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    normed_projection,
    silu_mul_projection,
    uses_silu_epilogue,
)
from pocketllm.layers.norm import RMSNorm
from pocketllm.layers.rotary import RotaryEmbedding, rope_settings
from pocketllm.step.attention_metadata import AttentionMetadata


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _product(module: nn.Module) -> ProductPlan | None:
    """A projection's decode product (linear layers and the CPU weight formats export one), else None."""
    export = getattr(module, "decode_product", None)
    return export() if export is not None else None


def _norm(module: nn.Module | None) -> NormPlan | None:
    """An RMSNorm's plan (None for a missing or zero-centred one)."""
    return module.decode_plan() if isinstance(module, RMSNorm) else None


class SelfAttention(nn.Module):
    """QKV projection, optional per-head q/k RMSNorm, rotary embedding, paged attention, output projection."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, prologue="rms_norm")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        bias=getattr(config, "o_bias", False))
        self.rotary_emb = rotary
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, head_dim, self.num_kv_heads, head_dim ** -0.5, sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attend(positions, self.qkv_proj(hidden), meta)

    def decode_plan(self) -> AttentionPlan | None:
        """The attention between the projections as a decode plan (None: partial rotary, an offset q/k norm)."""
        rotary = self.rotary_emb.decode_plan()
        q_norm, k_norm = _norm(self.q_norm), _norm(self.k_norm)
        if rotary is None or (self.q_norm is not None and (q_norm is None or k_norm is None)):
            return None
        return AttentionPlan(self.num_heads, self.num_kv_heads, self.head_dim, self.attn.scale, rotary, q_norm,
                             k_norm, self.attn, self.attn.sliding_window)

    def attend(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Everything after the QKV projection."""
        if self.attn.backend.supports_packed and self.rotary_emb.rotary_dim == self.head_dim:
            return self.o_proj(self.attn.forward_packed(qkv, positions, self.rotary_emb, self.q_norm, self.k_norm,
                                                        meta))
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). ``after_norm``: a block's norm comes right before it
    (``forward_normed``), which its first projection may fuse (a MoE's shared expert has none)."""

    def __init__(self, hidden_size: int, intermediate_size: int, after_norm: bool = True) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2,
                                                       prologue="rms_norm" if after_norm else None,
                                                       epilogue="silu_mul")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, prologue="silu_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if uses_silu_epilogue(self.gate_up_proj, x):
            return self.down_proj(self.gate_up_proj.forward_silu(x)[0])
        return silu_mul_projection(self.down_proj, self.gate_up_proj(x))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(norm(x + residual)), x + residual)``, the norm fused into the first projection where the
        model runner measured that faster."""
        if uses_silu_epilogue(self.gate_up_proj, x):
            activated, residual = self.gate_up_proj.forward_silu(x, residual, norm)
            return self.down_proj(activated), residual
        gate_up, residual = normed_projection(self.gate_up_proj, x, residual, norm)
        return silu_mul_projection(self.down_proj, gate_up), residual


class PreNormBlock(nn.Module):
    """Token mixer and feed-forward, each after a norm, with the residual carried through the norms.

    Subclasses set ``input_layernorm``, ``post_attention_layernorm`` and ``mlp`` and define ``mix``; a subclass
    whose mixer starts with a projection overrides ``mix_normed`` to hand the norm to that projection (which
    fuses it into its kernel where measured faster), as a ``GatedMLP`` feed-forward does.
    """

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        raise NotImplementedError

    def decode_plan(self) -> LayerPlan | None:
        """This block as a decode plan's layer; None (the default) where the plan cannot describe it."""
        return None

    def mix_normed(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mix(input_layernorm(hidden + residual)), hidden + residual)`` (no residual: the first layer)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.mix(positions, hidden, meta), residual

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.mix_normed(positions, hidden, residual, meta)
        forward_normed = getattr(self.mlp, "forward_normed", None)   # a feed-forward that fuses the norm
        if forward_normed is not None:
            return forward_normed(hidden, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderLayer(PreNormBlock):
    """Self-attention and feed-forward (the Llama / Qwen2 / Qwen3 layer)."""

    def __init__(self, config: Any, mlp: nn.Module, qkv_bias: bool, qk_norm: bool, rotary: RotaryEmbedding,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(config, qkv_bias, qk_norm, rotary, sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def mix(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.self_attn(positions, hidden, meta)

    def decode_plan(self) -> LayerPlan | None:
        """The layer as a decode plan's layer; None with another feed-forward (experts) or parts it cannot
        describe."""
        if type(self.mlp) is not GatedMLP:
            return None
        parts = (_norm(self.input_layernorm), _product(self.self_attn.qkv_proj), self.self_attn.decode_plan(),
                 _product(self.self_attn.o_proj), _norm(self.post_attention_layernorm),
                 _product(self.mlp.gate_up_proj), _product(self.mlp.down_proj))
        return None if any(part is None for part in parts) else LayerPlan(*parts)

    def mix_normed(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                   meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = normed_projection(self.self_attn.qkv_proj, hidden, residual, self.input_layernorm)
        return self.self_attn.attend(positions, qkv, meta), residual


class CausalLM(nn.Module):
    """Embedding, a stack of decoder layers, final norm and LM head.

    Subclasses choose each layer's feed-forward block and the attention options; everything else,
    including how checkpoint names map onto the fused parameters, is shared.
    """

    qkv_bias = False
    qk_norm = False
    packed_modules = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.sliding_windows = self.layer_windows(config)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def kv_window(self) -> int | None:
        """The longest sliding window when every layer slides: the paged KV cache holds nothing else, so the
        blocks of positions older than it may be released while a request runs. None when any layer attends
        fully. (A model that keeps other data in the cache by position declares no ``kv_window``.)"""
        windows = self.sliding_windows
        return None if not windows or any(window is None for window in windows) else max(windows)

    def layer_windows(self, config: Any) -> list[int | None]:
        """Each layer's sliding window (None: full attention), as transformers reads this family's config
        (``models/windows.py``). Llama: none (transformers' Llama ignores a ``sliding_window`` entry)."""
        return [None] * config.num_hidden_layers

    def make_layer(self, config: Any, layer_index: int) -> nn.Module:
        qkv_bias = getattr(config, "attention_bias", self.qkv_bias) or self.qkv_bias
        if getattr(self, "rotary_emb", None) is None:
            head_dim = head_dim_of(config)
            theta, scaling = rope_settings(config)
            # One table shared by every layer (a table a layer cost 20 ms each and 2 MB at 8,192 positions).
            self.rotary_emb = RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling)
        return DecoderLayer(config, self.make_mlp(config, layer_index), qkv_bias, self.qk_norm, self.rotary_emb,
                            self.sliding_windows[layer_index])

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size)

    def decode_plan(self) -> DecodePlan | None:
        """The decode step as a plan (``layers/decode_plan.py``), built from the weights as they are now (after
        any CPU weight conversion); None on several ranks or where some layer is not one the plan describes."""
        if tp_size() != 1:
            return None
        layers = tuple(layer.decode_plan() for layer in self.layers)
        final_norm = _norm(self.norm)
        if final_norm is None or not layers or any(layer is None for layer in layers):
            return None
        return DecodePlan(self.embed_tokens.weight, layers, final_norm)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the final norm."""
        hidden, _ = self.norm(*self.unnormed(input_ids, positions, meta))
        return hidden

    def unnormed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream): what the final norm adds up and normalises."""
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        return hidden, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of hidden states after the final norm."""
        return self.lm_head(hidden)

    def logits_unnormed(self, hidden: torch.Tensor, residual: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of rows of ``unnormed``'s output (the final norm runs in the head's kernel where that measured
        faster), written into ``out`` if given."""
        return self.lm_head.forward_normed(hidden, residual, self.norm, out)

    def checkpoint_name(self, name: str) -> str:
        """The parameter name a checkpoint (HF layout) entry maps to, before packing."""
        return name.removeprefix("model.")


class LlamaForCausalLM(CausalLM):
    """Llama 2/3 and SmolLM2 (Llama-3 rope scaling through the config)."""
