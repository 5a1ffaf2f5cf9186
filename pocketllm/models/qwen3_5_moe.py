"""Qwen3.5-MoE: the Qwen3.5 hybrid decoder with a routed mixture of experts plus a gated shared expert."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pocketllm.layers.linear import RowParallelLinear, normed_projection_keeping_input, silu_mul_projection
from pocketllm.layers.moe import FusedMoE, SharedExpertInput
from pocketllm.layers.norm import RMSNorm
from pocketllm.models.qwen3_5 import Qwen3_5ForCausalLM


class SharedExpertMoeBlock(nn.Module):
    """Top-k routed experts (softmax, renormalised) plus ``sigmoid(shared_gate(x)) * shared_expert(x)``, where the
    router, the shared gate and the shared expert's [gate; up] projection are one product of the input
    (``input_proj``) and the shared expert's down projection takes SiLU·mul of its part (``shared_down``)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.input_proj = SharedExpertInput(config.hidden_size, config.num_experts,
                                            config.shared_expert_intermediate_size)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=True)
        self.shared_down = RowParallelLinear(config.shared_expert_intermediate_size, config.hidden_size,
                                             prologue="silu_mul")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._experts(hidden, self.input_proj(hidden))

    def forward_normed(self, x: torch.Tensor, residual: torch.Tensor | None,
                       norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """``(forward(norm(x + residual)), x + residual)``, the norm in the input product's kernel where the
        model runner measured that faster (which then writes the normed input the experts read)."""
        projected, residual, normed = normed_projection_keeping_input(self.input_proj, x, residual, norm)
        return self._experts(normed, projected), residual

    def _experts(self, hidden: torch.Tensor, projected: torch.Tensor) -> torch.Tensor:
        # the input product's rows: [router | shared gate | shared gate and up] (views; the CPU's weight formats
        # replace ``input_proj`` by a module of their own, which keeps the rows)
        experts = self.experts.num_experts
        router_logits, shared_gate = projected[:, :experts], projected[:, experts:experts + 1]
        shared = silu_mul_projection(self.shared_down, projected[:, experts + 1:])
        return self.experts(hidden, router_logits, (shared_gate, shared))


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    # The block's input products load into one weight (``SharedExpertInput``); listed first, so that the shared
    # expert's gate_proj and up_proj do not match the dense MLP's entries below.
    packed_modules = {
        "mlp.gate": ("mlp.input_proj", "router"),
        "mlp.shared_expert_gate": ("mlp.input_proj", "shared_gate"),
        "mlp.shared_expert.gate_proj": ("mlp.input_proj", "gate"),
        "mlp.shared_expert.up_proj": ("mlp.input_proj", "up"),
        **Qwen3_5ForCausalLM.packed_modules,
    }

    def make_mlp(self, config: Any, layer_index: int) -> nn.Module:
        return SharedExpertMoeBlock(config)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else name.replace(".mlp.shared_expert.down_proj.", ".mlp.shared_down.")
