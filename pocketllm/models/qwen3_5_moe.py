"""Qwen3.5-MoE: the Qwen3.5 hybrid decoder with a routed mixture of experts plus a gated shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.layers.moe import FusedMoE
from pocketllm.models.llama import GatedMLP
from pocketllm.models.qwen3_5 import Qwen3_5ForCausalLM


class SharedExpertMoeBlock(nn.Module):
    """Top-k routed experts (softmax, renormalised) plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=True)
        self.shared_expert = GatedMLP(config.hidden_size, config.shared_expert_intermediate_size, after_norm=False)
        self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden, self.gate(hidden), (self.shared_expert_gate(hidden), self.shared_expert(hidden)))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        return SharedExpertMoeBlock(config)
