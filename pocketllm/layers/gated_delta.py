"""Gated DeltaNet (Qwen3.5's linear-attention layers): causal conv1d, the gated delta rule, gated RMSNorm.

The delta rule keeps, per value head, a state ``S`` of shape [key_dim, value_dim]. For every token ``t``
(queries and keys L2-normalised, the query also scaled by ``key_dim ** -0.5``)::

    S = exp(g_t) * S                       # decay
    S = S + k_t (beta_t * (v_t - S^T k_t))^T   # delta-rule write of what S did not already predict
    o_t = S^T q_t

``recurrent_gated_delta_rule`` runs that loop (decode: one token per sequence, batched). The chunked form
(prefill) handles ``chunk_size`` tokens at a time: inside a chunk the writes are a unit-lower-triangular
system solved in one batched triangular solve, and only the chunk-to-chunk state hand-off is sequential.

Per-request states live in slots of a pool bound by the model runner: ``conv_state`` [slots, K-1, channels]
(the last K-1 conv inputs) and ``ssm_state`` [slots, value_heads, key_dim, value_dim] (float32). A sequence
whose chunk starts at position 0 starts from zeros, whatever the slot held before.

This module is the reference (CPU, and CUDA without the fast paths). On CUDA ``gated_delta_backend`` picks the
fast paths: a two-launch Triton decode step (``kernels/gated_delta.py``) and a one-launch chunked prefill, fla's
(``kernels/gated_delta_fla.py``, optional package) or ours (``kernels/gated_delta_prefill.py``); the rule is
documented in ``layers/gated_delta_backend.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import tp_rank, tp_size
from pocketllm.layers.gated_delta_backend import gated_delta_backend
from pocketllm.layers.linear import ColumnParallelLinear, RowParallelLinear, split_over_ranks
from pocketllm.step.attention_metadata import AttentionMetadata


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the convention of the reference kernels)."""
    return x * torch.rsqrt(x.square().sum(dim=-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------------------------- the rule


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule.

    ``q``/``k`` [..., L, Dk] (prepared: normalised, q scaled), ``v`` [..., L, Dv], ``g``/``beta`` [..., L],
    ``state`` [..., Dk, Dv]; all float32. Returns (out [..., L, Dv], final state).
    """
    outs = []
    for t in range(k.shape[-2]):
        state = state * g[..., t, None, None].exp()
        predicted = torch.einsum("...k,...kv->...v", k[..., t, :], state)
        delta = beta[..., t, None] * (v[..., t, :] - predicted)
        state = state + k[..., t, :, None] * delta[..., None, :]
        outs.append(torch.einsum("...k,...kv->...v", q[..., t, :], state))
    return torch.stack(outs, dim=-2), state


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result as ``recurrent_gated_delta_rule``, ``chunk_size`` tokens per sequential step.

    Within a chunk, with ``c_t`` the cumulative log-decay from the chunk start and ``S0`` the incoming state,
    the writes ``d_s = beta_s (v_s - S_{s-1}^T k_s)`` satisfy ``(I + A) d = beta v - beta e^c (K S0)`` where
    ``A[s, r] = beta_s e^(c_s - c_r) k_s.k_r`` for ``r < s``; outputs and the outgoing state follow from ``d``.
    """
    length = k.shape[-2]
    pad = -length % chunk_size
    if pad:
        # Zero keys and betas write nothing and zero log-decay keeps the state: padding is inert.
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    lead = k.shape[:-2]
    n = k.shape[-2] // chunk_size
    q, k, v = (x.reshape(*lead, n, chunk_size, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(*lead, n, chunk_size) for x in (g, beta))

    cum = g.cumsum(dim=-1)                                        # [..., n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    system = system.tril(-1) + torch.eye(chunk_size, dtype=k.dtype, device=k.device)
    writes_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    writes_k = torch.linalg.solve_triangular(system, k * (beta * cum.exp())[..., None], upper=False,
                                             unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay                    # causal, diagonal included
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]             # [..., n, 1, 1]

    out = torch.empty_like(v)
    for i in range(n):
        writes = writes_v[..., i, :, :] - writes_k[..., i, :, :] @ state
        out[..., i, :, :] = q_decayed[..., i, :, :] @ state + scores[..., i, :, :] @ writes
        state = state * chunk_decay[..., i, :, :] + k_to_end[..., i, :, :].transpose(-1, -2) @ writes
    return out.reshape(*lead, n * chunk_size, v.shape[-1])[..., :length, :], state


# ---------------------------------------------------------------------------------------------- conv1d


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of one sequence chunk.

    ``x`` [L, C], ``weight`` [C, K], ``previous`` [K-1, C] (the inputs before this chunk; zeros at the start).
    Returns (out [L, C], the last K-1 inputs for the next chunk).
    """
    window = torch.cat([previous.to(x.dtype), x], dim=0)         # [L + K - 1, C]
    out = F.conv1d(window.t().unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])
    return out[0].t(), window[window.shape[0] - previous.shape[0]:]


def causal_conv1d_step(x: torch.Tensor, weight: torch.Tensor,
                       previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: ``x`` [B, C], ``previous`` [B, K-1, C] → (out [B, C], new state [B, K-1, C])."""
    window = torch.cat([previous.to(x.dtype), x.unsqueeze(1)], dim=1)   # [B, K, C]
    out = torch.einsum("bkc,ck->bc", window, weight)
    return out, window[:, 1:]


# ------------------------------------------------------------------------------------------------ layers


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm of the rule's output, then multiplied by ``silu(gate)``."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        normed = x.float() * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps)
        normed = self.weight * normed.to(dtype)
        return (normed * F.silu(gate.float())).to(dtype)


def rank_rows(loaded: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """This tensor-parallel rank's share of each of the consecutive row blocks ``sizes`` of ``loaded``
    (every block is split by head, so each rank keeps whole heads of q, k, v, ...)."""
    if tp_size() == 1:
        return loaded
    parts, start = [], 0
    for size in sizes:
        local = size // tp_size()
        parts.append(loaded[start + tp_rank() * local:start + (tp_rank() + 1) * local])
        start += size
    return torch.cat(parts, dim=0)


class CausalConv1dWeight(nn.Module):
    """The depthwise conv kernel [channels, K]; checkpoints store it as [channels, 1, K]."""

    def __init__(self, part_sizes: list[int], kernel_size: int) -> None:
        super().__init__()
        self.part_sizes = part_sizes
        self.weight = nn.Parameter(torch.empty(sum(part_sizes) // tp_size(), kernel_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(rank_rows(loaded.reshape(loaded.shape[0], -1), self.part_sizes))


class GatedDeltaInProj(ColumnParallelLinear):
    """``in_proj_qkv``, ``in_proj_z``, ``in_proj_b`` and ``in_proj_a`` as one column-parallel weight.

    Rows per rank: [q | k | v | z | b | a], each part sharded by head.
    """

    def __init__(self, hidden_size: int, key_dim: int, value_dim: int, num_v_heads: int) -> None:
        self.parts = {"qkv": [key_dim, key_dim, value_dim], "z": [value_dim], "b": [num_v_heads],
                      "a": [num_v_heads]}
        super().__init__(hidden_size, 2 * key_dim + 2 * value_dim + 2 * num_v_heads, prologue="rms_norm")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset = 0
        for name, sizes in self.parts.items():
            local = sum(sizes) // self.tp_size
            if name == shard_id:
                param.data.narrow(0, offset, local).copy_(rank_rows(loaded, sizes))
                return
            offset += local
        raise KeyError(shard_id)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention token mixer over per-request state slots."""

    def __init__(self, config: Any, chunk_size: int = 64) -> None:
        super().__init__()
        # Head-sharded: each rank holds whole key and value heads (their q/k/v/z/b/a rows and conv channels, their
        # recurrent state in its own slots); the output projection is row-parallel (one all-reduce).
        self.num_k_heads = split_over_ranks(config.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = split_over_ranks(config.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim            # per rank
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = config.linear_conv_kernel_dim
        self.chunk_size = chunk_size
        full_key = config.linear_num_key_heads * self.head_k_dim
        full_value = config.linear_num_value_heads * self.head_v_dim
        self.in_proj = GatedDeltaInProj(config.hidden_size, full_key, full_value, config.linear_num_value_heads)
        self.conv1d = CausalConv1dWeight([full_key, full_key, full_value], self.kernel_size)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        for param in (self.A_log, self.dt_bias):
            param.weight_loader = lambda p, loaded: p.data.copy_(rank_rows(loaded, [loaded.shape[0]]))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps)
        self.out_proj = RowParallelLinear(full_value, config.hidden_size)
        self.conv_state = torch.empty(0)
        self.ssm_state = torch.empty(0)

    def state_specs(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shape and dtype of each state tensor (the runner allocates ``[slots, *shape]``)."""
        return {
            "conv_state": ((self.kernel_size - 1, self.conv_dim), dtype),
            "ssm_state": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        }

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.forward_projected(self.in_proj(hidden), meta)

    def forward_projected(self, proj: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The mixer after its input projection ``proj`` (which a decoder layer may compute with its norm fused)."""
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        if meta.state_slots is None:
            raise RuntimeError("GatedDeltaNet needs per-sequence state slots in the attention metadata")
        backend = gated_delta_backend(proj, meta)
        if meta.state_checkpoints_host is not None:
            # A step with verify chunks (speculative decoding): those token by token, as decode steps run them,
            # keeping the state after each position (``_checkpointed``); the other sequences as in any mixed step.
            beta = b.float().sigmoid()
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
            core = torch.cat([self._checkpointed(mixed, g, beta, meta, i) if meta.state_checkpoints_host[i] >= 0
                              else self._sequence(mixed, g, beta, meta, i) for i in range(meta.num_seqs)], dim=0)
            core = self.norm(core.to(proj.dtype), z.reshape(-1, self.num_v_heads, self.head_v_dim))
            return self.out_proj(core.reshape(proj.shape[0], self.value_dim))
        if backend.decode == "triton":
            from pocketllm.kernels.gated_delta import gated_delta_decode

            core = gated_delta_decode(mixed, a, b, self.conv1d.weight, self.A_log, self.dt_bias, self.conv_state,
                                      self.ssm_state, meta.state_slots, meta.context_lens_gpu, self.num_k_heads,
                                      self.num_v_heads, self.head_k_dim, self.head_v_dim, z=z,
                                      norm_weight=self.norm.weight, eps=self.norm.eps, chain=meta.state_chain)
            return self.out_proj(core)
        if meta.state_chain is not None:
            raise RuntimeError("rows in state chains need the Triton decode step")
        beta = b.float().sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        if meta.is_decode_only:
            core = self._decode(mixed, g, beta, meta)
        elif backend.prefill != "torch":
            core = self._prefill_flat(mixed, g, beta, meta, backend.prefill)
        else:
            core = torch.cat([self._sequence(mixed, g, beta, meta, i) for i in range(meta.num_seqs)], dim=0)
        core = self.norm(core.to(proj.dtype), z.reshape(-1, self.num_v_heads, self.head_v_dim))
        return self.out_proj(core.reshape(proj.shape[0], self.value_dim))

    def _heads(self, mixed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split conv output [T, conv_dim] into float32 q, k [T, Hv, Dk] (prepared) and v [T, Hv, Dv]."""
        q, k, v = F.silu(mixed).split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        tokens = q.shape[0]
        q = l2_normalize(q.float().reshape(tokens, self.num_k_heads, self.head_k_dim))
        k = l2_normalize(k.float().reshape(tokens, self.num_k_heads, self.head_k_dim))
        groups = self.num_v_heads // self.num_k_heads
        if groups > 1:
            q, k = q.repeat_interleave(groups, dim=1), k.repeat_interleave(groups, dim=1)
        return q * self.head_k_dim ** -0.5, k, v.float().reshape(tokens, self.num_v_heads, self.head_v_dim)

    def _conv_sequence(self, mixed: torch.Tensor, meta: AttentionMetadata, i: int) -> tuple[torch.Tensor, bool]:
        """Sequence ``i``'s conv output [L, conv_dim] (its conv-state slot updated) and whether it starts fresh."""
        start, end = meta.query_start[i], meta.query_start[i + 1]
        slot = meta.state_slots_host[i]
        fresh = meta.context_lens[i] == end - start
        conv_prev = torch.zeros_like(self.conv_state[slot]) if fresh else self.conv_state[slot]
        conv_out, conv_next = causal_conv1d(mixed[start:end], self.conv1d.weight, conv_prev)
        self.conv_state[slot] = conv_next.to(self.conv_state.dtype)
        return conv_out, fresh

    def _sequence(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                  i: int) -> torch.Tensor:
        start, end = meta.query_start[i], meta.query_start[i + 1]
        slot = meta.state_slots_host[i]
        conv_out, fresh = self._conv_sequence(mixed, meta, i)
        q, k, v = self._heads(conv_out)
        state = torch.zeros_like(self.ssm_state[slot]) if fresh else self.ssm_state[slot]
        gs, bs = g[start:end].t(), beta[start:end].t()               # [Hv, L]
        qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
        if end - start == 1:
            out, state = recurrent_gated_delta_rule(qh, kh, vh, gs, bs, state)
        else:
            out, state = chunk_gated_delta_rule(qh, kh, vh, gs, bs, state, self.chunk_size)
        self.ssm_state[slot] = state
        return out.transpose(0, 1)                                   # [L, Hv, Dv]

    def _checkpointed(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                      i: int) -> torch.Tensor:
        """Verify chunk ``i`` one token at a time with the decode step's arithmetic (``_decode`` for one row), so
        that its outputs equal the decode steps it stands for, writing its state after each position but the
        last into consecutive checkpoint slots: the engine rolls the request's slot back to the one after its
        last accepted proposal. (A verify chunk never starts a sequence.)"""
        start, end = meta.query_start[i], meta.query_start[i + 1]
        slot, first = meta.state_slots_host[i], meta.state_checkpoints_host[i]
        conv, ssm = self.conv_state[slot:slot + 1], self.ssm_state[slot:slot + 1]
        outs = []
        for t in range(start, end):
            conv_out, conv = causal_conv1d_step(mixed[t:t + 1], self.conv1d.weight, conv)
            q, k, v = self._heads(conv_out)
            out, ssm = recurrent_gated_delta_rule(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2),
                                                  g[t:t + 1].unsqueeze(2), beta[t:t + 1].unsqueeze(2), ssm)
            outs.append(out.squeeze(2))
            if t < end - 1:
                self.conv_state[first + t - start] = conv[0].to(self.conv_state.dtype)
                self.ssm_state[first + t - start] = ssm[0]
        self.conv_state[slot] = conv[0].to(self.conv_state.dtype)
        self.ssm_state[slot] = ssm[0]
        return torch.cat(outs, dim=0)                                # [L, Hv, Dv]

    def _prefill_flat(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, meta: AttentionMetadata,
                      rule: str) -> torch.Tensor:
        """Every sequence of the batch through one launch of the chunked rule (``rule``: ``fla`` or ``triton``),
        each from its slot's state (zeros when fresh). With ``triton`` the convs are one flat pass too; with fla
        they run per sequence as on the reference path."""
        n = meta.num_seqs
        scale = self.head_k_dim ** -0.5
        if meta.query_start_gpu is not None and meta.context_lens_gpu is not None:
            # a sequence keeps its state unless this chunk is all of it (no copy from the host here)
            cu = meta.query_start_gpu[:n + 1]
            keep = (meta.context_lens_gpu[:n] != cu[1:] - cu[:-1]).to(torch.int32)
        else:
            cu = torch.tensor(meta.query_start, dtype=torch.int32, device=mixed.device)
            keep = torch.tensor([meta.context_lens[i] != meta.query_start[i + 1] - meta.query_start[i]
                                 for i in range(n)], dtype=torch.int32, device=mixed.device)
        if rule == "triton":   # (the kernel path: the metadata's device lengths and longest chunk are set)
            from pocketllm.kernels.gated_delta_prefill import chunked_prefill, conv_prefill

            activated = conv_prefill(mixed, self.conv1d.weight, self.conv_state, meta.state_slots, keep, cu,
                                     meta.max_query_len)
            return chunked_prefill(*self._flat_heads(activated), g, beta, self.ssm_state, meta.state_slots, keep, cu,
                                   scale, torch.float32)
        from pocketllm.kernels.gated_delta_fla import fla_chunk_prefill

        q, k, v = self._flat_heads(F.silu(torch.cat([self._conv_sequence(mixed, meta, i)[0] for i in range(n)])))
        slots = meta.state_slots.long()
        state = torch.where(keep.bool()[:, None, None, None], self.ssm_state.index_select(0, slots), 0)
        out, state = fla_chunk_prefill(q, k, v, g, beta, state, cu, meta.query_start, scale)
        self.ssm_state.index_copy_(0, slots, state.to(self.ssm_state.dtype))
        return out

    def _flat_heads(self, activated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Raw q, k [T, Hk, Dk] and v [T, Hv, Dv]: views of the conv's activated output [T, conv_dim]."""
        tokens = activated.shape[0]
        q, k, v = activated.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(tokens, self.num_k_heads, self.head_k_dim),
                k.reshape(tokens, self.num_k_heads, self.head_k_dim),
                v.reshape(tokens, self.num_v_heads, self.head_v_dim))

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One token for every sequence, batched; a one-token prompt (context 1) starts from zeros.

        On the kernel path nothing here reads host lists, so the step can be captured in a CUDA graph (the
        context lengths come from the device copy)."""
        slots = meta.state_slots.long()
        conv_prev = self.conv_state.index_select(0, slots)
        ssm = self.ssm_state.index_select(0, slots)
        if meta.context_lens_gpu is not None:
            keep = meta.context_lens_gpu > 1
            conv_prev = torch.where(keep[:, None, None], conv_prev, 0)
            ssm = torch.where(keep[:, None, None, None], ssm, 0)
        elif any(n == 1 for n in meta.context_lens):
            keep = torch.tensor([n > 1 for n in meta.context_lens], device=mixed.device)
            conv_prev = torch.where(keep[:, None, None], conv_prev, 0)
            ssm = torch.where(keep[:, None, None, None], ssm, 0)
        conv_out, conv_next = causal_conv1d_step(mixed, self.conv1d.weight, conv_prev)
        self.conv_state.index_copy_(0, slots, conv_next.to(self.conv_state.dtype))
        q, k, v = self._heads(conv_out)                              # [B, Hv, D]
        out, ssm = recurrent_gated_delta_rule(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), g.unsqueeze(2),
                                              beta.unsqueeze(2), ssm)
        self.ssm_state.index_copy_(0, slots, ssm)
        return out.squeeze(2)
