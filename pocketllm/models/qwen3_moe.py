"""Qwen3-MoE: Qwen3 attention with a routed mixture-of-experts feed-forward on sparse layers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.layers.moe import FusedMoE
from pocketllm.models.llama import GatedMLP
from pocketllm.models.qwen3 import Qwen3ForCausalLM
from pocketllm.models.windows import every_layer_if_enabled


class SparseMoeBlock(nn.Module):
    """Router (``gate``) plus stacked experts."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, bool(config.norm_topk_prob))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def layer_windows(self, config: Any) -> list[int | None]:
        return every_layer_if_enabled(config)

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        sparse_step = getattr(config, "decoder_sparse_step", 1) or 1
        dense = layer_index in (getattr(config, "mlp_only_layers", None) or [])
        if config.num_experts > 0 and not dense and (layer_index + 1) % sparse_step == 0:
            return SparseMoeBlock(config)
        return GatedMLP(config.hidden_size, config.intermediate_size)
