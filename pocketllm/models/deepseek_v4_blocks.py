"""DeepSeek-V4's decoder layer and its parts: hyper-connections with Sinkhorn mixing, the hyper-head, the
router (scored or hashed), the routed experts with the shared one; the attention is in
``deepseek_v4_attention.py``, the model in ``deepseek_v4.py``."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.kernels import available as kernels_available
from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.layers.moe import FusedMoE
from pocketllm.models.deepseek_v4_attention import DeepseekV4Attention, Fp32RMSNorm, InterleavedRotary, rms_normalize
from pocketllm.step.attention_metadata import AttentionMetadata

HASH_MOE, MOE = "hash_moe", "moe"
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}


# ------------------------------------------------------------------------------------------- hyper-connections

def sinkhorn(comb: torch.Tensor, iterations: int, eps: float) -> torch.Tensor:
    """Alternate column and row normalisation of [..., n, n] towards a doubly stochastic matrix (column first,
    ``iterations`` column passes); on CUDA in one launch (``kernels/sinkhorn.py``)."""
    if comb.is_cuda and kernels_available(comb.device) and comb.dim() == 3 and comb.dtype == torch.float32:
        from pocketllm.kernels.sinkhorn import sinkhorn_fused

        return sinkhorn_fused(comb, iterations, eps)
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: from the streams [T, n, D], the block input (``pre``-weighted
    sum), the output spread ``post`` [T, n] and the Sinkhorn-projected stream mix ``comb`` [T, n, n]."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        n = self.streams = config.hc_mult
        self.iterations, self.hc_eps, self.norm_eps = config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * config.hidden_size, dtype=torch.float32),
                               requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.streams
        mixes = F.linear(rms_normalize(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = sinkhorn(comb, self.iterations, self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return collapsed, post, comb

    @staticmethod
    def merge(streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The outgoing streams: stream ``k`` = ``post[k] * output + sum_j comb[j, k] * streams[j]``."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype).unsqueeze(-1) * output.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams: sigmoid-weighted sum from the normalised, flattened streams."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        n = config.hc_mult
        self.hc_eps, self.norm_eps = config.hc_eps, config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(rms_normalize(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


# ------------------------------------------------------------------------------------------------ feed-forward

def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)``."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert (clamped as the routed ones are)."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = ReplicatedLinear(hidden_size, intermediate_size)
        self.up_proj = ReplicatedLinear(hidden_size, intermediate_size)
        self.down_proj = ReplicatedLinear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


def hash_routing_table(table: torch.Tensor, generator: torch.Generator, experts: int) -> None:
    """Dummy weights' ``tid2eid`` [vocab, k]: each token's k experts distinct and in range, ``k`` consecutive ones
    (modulo ``experts``) from a random first one (a weight-like draw would route every token to expert 0)."""
    first = torch.randint(0, experts, (table.shape[0], 1), generator=generator, device=table.device)
    table.copy_((first + torch.arange(table.shape[1], device=table.device)) % experts)


class Router(nn.Module):
    """Expert choice and weights: scores ``score_fn(x W^T)``; top-k of scores plus ``e_score_correction_bias``,
    or (hashed) the experts ``tid2eid[token]``; chosen scores renormalised, times ``routed_scaling_factor``."""

    def __init__(self, config: Any, hashed: bool) -> None:
        super().__init__()
        experts = config.n_routed_experts
        self.top_k, self.hashed = config.num_experts_per_tok, hashed
        self.score = SCORING[config.scoring_func]
        self.scaling = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(experts, config.hidden_size), requires_grad=False)
        if hashed:
            self.tid2eid = nn.Parameter(torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64),
                                        requires_grad=False)
            self.tid2eid.dummy_fill = functools.partial(hash_routing_table, experts=experts)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32),
                                                        requires_grad=False)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.score(F.linear(hidden, self.weight))
        if self.hashed:
            chosen = self.tid2eid[input_ids].long()
        else:
            chosen = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, chosen)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, chosen


class DeepseekV4MoE(nn.Module):
    """Routed experts (stacked in a ``FusedMoE``'s weights) plus the shared expert."""

    def __init__(self, config: Any, hashed: bool) -> None:
        super().__init__()
        self.limit = float(config.swiglu_limit)
        self.gate = Router(config, hashed)
        self.experts = FusedMoE(config.n_routed_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=True)
        self.shared_experts = SharedExpert(config.hidden_size, config.moe_intermediate_size, self.limit)

    def forward(self, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(hidden, input_ids)
        if hidden.is_cuda and kernels_available(hidden.device):
            # The grouped expert kernels: nothing read back to the host (the loop below reads the experts used).
            from pocketllm.kernels.moe import fused_experts

            routed = fused_experts(hidden, self.experts.w13, self.experts.w2, weights, chosen, self.limit)
            return routed + self.shared_experts(hidden)
        routed = torch.zeros_like(hidden)
        flat = chosen.flatten()
        for expert in torch.unique(flat).tolist():
            rows = (flat == expert).nonzero().squeeze(1)
            tokens = rows // chosen.shape[1]
            gate, up = F.linear(hidden[tokens], self.experts.w13[expert]).chunk(2, dim=-1)
            out = F.linear(clamped_swiglu(gate, up, self.limit), self.experts.w2[expert])
            routed.index_add_(0, tokens, (out * weights.flatten()[rows, None]).to(routed.dtype))
        return routed + self.shared_experts(hidden)


# ------------------------------------------------------------------------------------------------------ layer

class DeepseekV4DecoderLayer(nn.Module):
    """Attention then feed-forward, each between a hyper-connection and a merge back into the streams."""

    def __init__(self, config: Any, layer_type: str, mlp_type: str, rotary: dict[str, InterleavedRotary]) -> None:
        super().__init__()
        self.self_attn = DeepseekV4Attention(config, layer_type, rotary)
        self.mlp = DeepseekV4MoE(config, mlp_type == HASH_MOE)
        self.input_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        collapsed, post, comb = self.attn_hc(streams)
        out = self.self_attn(positions, self.input_layernorm(collapsed), meta)
        streams = HyperConnection.merge(streams, out, post, comb)
        collapsed, post, comb = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        return HyperConnection.merge(streams, out, post, comb)
