"""Routed mixture of experts: top-k softmax router and expert-parallel-ready stacked expert weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import all_reduce, tp_rank, tp_size
from pocketllm.errors import CheckpointError
from pocketllm.kernels import available as kernels_available
from pocketllm.layers.linear import LinearBase, split_over_ranks


class FusedMoE(nn.Module):
    """``num_experts`` SwiGLU experts stored stacked; the intermediate dimension is split across ranks (every
    rank holds a slice of every expert, so routing needs no exchange; the partial outputs are summed by one
    all-reduce).

    ``w13`` is [E, 2*I/tp, H] (gate rows then up rows), ``w2`` is [E, H, I/tp].
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        self.shard = split_over_ranks(intermediate_size, "moe_intermediate_size")
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard), requires_grad=False)
        self.w13.weight_loader = self.weight_loader
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      expert: int | None = None) -> None:
        """``shard_id`` is ``gate``, ``up`` (into w13) or ``down`` (into w2) of expert ``expert``; without them
        ``loaded`` holds every expert stacked: gate and up rows [E, 2I, H] (w13) or down [E, H, I] (w2)."""
        start = self.tp_rank * self.shard
        if shard_id is None:
            if param is self.w2:
                param.data.copy_(loaded.narrow(2, start, self.shard))
                return
            full = loaded.shape[1] // 2
            param.data.copy_(torch.cat([loaded.narrow(1, start, self.shard),
                                        loaded.narrow(1, full + start, self.shard)], dim=1))
            return
        if shard_id == "down":
            param.data[expert].copy_(loaded.narrow(1, start, self.shard))
            return
        offset = 0 if shard_id == "gate" else self.shard
        param.data[expert].narrow(0, offset, self.shard).copy_(loaded.narrow(0, start, self.shard))

    def route(self, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts per token and their weights (softmax in float32, optionally renormalised)."""
        probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(router_logits.dtype), experts

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor,
                shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The routed experts' output; with ``shared`` (gate logit [T, 1], a shared expert's whole output
        [T, H]) plus ``sigmoid(gate) * output`` (on the kernel path on one rank, in the experts' last launch)."""
        if hidden.is_cuda and kernels_available(hidden.device):
            # Routing in one launch, the experts in a few, nothing read back to the host (kernels/moe.py):
            # CUDA-graph safe.
            from pocketllm.kernels.moe import fused_experts, route_top_k

            weights, experts = route_top_k(router_logits, self.top_k, self.renormalize)
            if self.tp_size == 1:
                return fused_experts(hidden, self.w13, self.w2, weights, experts, shared=shared)
            routed = all_reduce(fused_experts(hidden, self.w13, self.w2, weights, experts))
        else:
            weights, experts = self.route(router_logits)
            routed = all_reduce(self._loop_experts(hidden, weights, experts))
        if shared is None:
            return routed
        gate, output = shared
        return routed + torch.sigmoid(gate) * output

    def _loop_experts(self, hidden: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The PyTorch reference: one pass per expert that received tokens (reads the counts on the host)."""
        out = torch.zeros_like(hidden)
        flat_experts = experts.flatten()
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            idx = order[start:start + count]
            tokens = token_of[start:start + count]
            start += count
            gate, up = F.linear(hidden[tokens], self.w13[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2[expert])
            y = y * weights.flatten()[idx, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out


class SharedExpertInput(LinearBase):
    """What a MoE block with a gated shared expert (Qwen3.5-MoE) computes from its input first, as one weight:
    the router (``num_experts`` rows), the shared expert's gate logit (one row) and the shared expert's gate and
    up projections (this rank's share of their rows each), in that order. A decode step runs them, and the
    block's norm where the model runner timed that faster, in one launch instead of three or four.
    """

    PARTS = ("router", "shared_gate", "gate", "up")

    def __init__(self, hidden_size: int, num_experts: int, shared_intermediate_size: int) -> None:
        self.num_experts = num_experts
        self.shard = split_over_ranks(shared_intermediate_size, "shared_expert_intermediate_size")
        super().__init__(hidden_size, num_experts + 1 + 2 * self.shard, bias=False, tp_dim=None,
                         prologue="rms_norm")

    def _rows(self, part: str) -> tuple[int, int]:
        """(first row, row count) of ``part`` in this rank's weight."""
        experts, shard = self.num_experts, self.shard
        return {"router": (0, experts), "shared_gate": (experts, 1), "gate": (experts + 1, shard),
                "up": (experts + 1 + shard, shard)}[part]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """``shard_id`` names the checkpoint part (``PARTS``); without it ``loaded`` is the unsharded layer's
        whole weight (every part, in order)."""
        if shard_id is None:
            shared = (loaded.shape[0] - self.num_experts - 1) // 2
            for part, tensor in zip(self.PARTS, loaded.split([self.num_experts, 1, shared, shared])):
                self.weight_loader(param, tensor, part)
            return
        first, rows = self._rows(shard_id)
        if shard_id in ("gate", "up"):
            full = (rows * self.tp_size, param.shape[1])
            if tuple(loaded.shape) != full:
                raise CheckpointError(f"shared expert {shard_id}_proj: checkpoint shape {tuple(loaded.shape)}, "
                                      f"expected {full}")
            loaded = loaded.narrow(0, self.tp_rank * rows, rows)
        elif tuple(loaded.shape) != (rows, param.shape[1]):
            raise CheckpointError(f"MoE {shard_id}: checkpoint shape {tuple(loaded.shape)}, expected "
                                  f"{(rows, param.shape[1])}")
        param.data.narrow(0, first, rows).copy_(loaded)
