"""DeepSeek-V4's attention (``deepseek_v4.py`` describes the model): shared-KV multi-query attention over the
sliding window plus the compressed history (heavily compressed and compressed sparse layers, the lightning
indexer), its interleaved rotary, norms and grouped low-rank output projection, and the paged rows the compressed
entries live in."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.layers.attention import Attention
from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.models.windows import checked_window
from pocketllm.step.attention_metadata import AttentionMetadata

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


# ----------------------------------------------------------------------------------------- rotary and norms

def rope_inv_freq(rope_dim: int, params: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rope_dim / 2], cos/sin scale) of a default or YaRN rotary over ``rope_dim``."""
    base = float(params["rope_theta"])
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    plain = 1.0 / (base ** exponents)
    if params.get("rope_type", "default") == "default":
        return plain, 1.0
    factor = float(params["factor"])
    original = float(params["original_max_position_embeddings"])
    scale = params.get("attention_factor")
    if scale is None:
        def mscale(value: float) -> float:
            return 1.0 if factor <= 1 else 0.1 * value * math.log(factor) + 1.0
        both = params.get("mscale") and params.get("mscale_all_dim")
        scale = mscale(params["mscale"]) / mscale(params["mscale_all_dim"]) if both else mscale(1.0)
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:  # the channel whose wavelength makes ``rotations`` turns in context
        return rope_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for(fast), dim_for(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp   # 1: the channel keeps its frequency (extrapolation), 0: it is divided by ``factor``
    return plain / factor * (1 - keep) + plain * keep, float(scale)


class InterleavedRotary(nn.Module):
    """Rotary on the trailing ``rope_dim`` channels, consecutive channel pairs rotating together."""

    def __init__(self, rope_dim: int, params: dict[str, Any]) -> None:
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope_dim, params)
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rope_dim / 2] at ``positions`` [T], rounded to ``dtype`` as the reference rounds them."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [T, ..., D] with its last ``2 * cos.shape[-1]`` channels rotated by angles (cos, sin) [T, R/2]."""
        shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.reshape(shape).float(), sin.reshape(shape).float()
        rope_dim = 2 * cos.shape[-1]
        rest, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        return torch.cat((rest, turned.to(x.dtype)), dim=-1)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions, x.dtype)
        return self.rotate(x, cos, sin)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMSNorm over the last dimension (float32 statistics)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Fp32RMSNorm(nn.Module):
    """RMSNorm with a float32 weight, applied in float32 and rounded once to the input's dtype."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * normed).to(x.dtype)


class GroupedLinear(nn.Module):
    """Block-diagonal projection: input [T, G * I] in ``groups`` slices, each mapped by its own [R, I] block."""

    def __init__(self, in_per_group: int, out_features: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = self.weight.view(self.groups, -1, self.weight.shape[-1])       # [G, R, I]
        grouped = x.reshape(x.shape[0], self.groups, -1)                         # [T, G, I]
        return torch.einsum("tgi,gri->tgr", grouped, blocks).reshape(x.shape[0], -1)


# ------------------------------------------------------------------------------------------- paged cache rows

def cache_slots(table: torch.Tensor, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots of a sequence's rows ``indices`` (token positions or entry indices) via its block table."""
    return table[indices // block_size] * block_size + indices % block_size


def read_rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Rows [n, D] of a one-head paged cache [blocks, block_size, 1, D]."""
    return cache.view(-1, cache.shape[-1]).index_select(0, slots)


def write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, rows.to(cache.dtype))


def table_slots(tables: torch.Tensor, indices: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache slots [B, n] of rows ``indices`` [B, n] (non-negative) of each sequence, through its row of
    ``tables`` [B, max_blocks]."""
    return tables.gather(1, indices // block_size) * block_size + indices % block_size


def entries_of_rows(cache: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor, most: int,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Each sequence's first ``counts[b]`` paged entries, padded to the ``most`` of them (known on the host): rows
    [B, n, D] and which are real (bool [B, n]); (None, None) when no sequence has one."""
    if most == 0:
        return None, None
    index = torch.arange(most, device=tables.device)[None, :].expand(counts.shape[0], -1)
    real = index < counts[:, None]
    rows = read_rows(cache, table_slots(tables, index, block_size).flatten())
    return rows.view(counts.shape[0], most, -1), real


# ------------------------------------------------------------------------------------------------ compressors

class WindowPool(nn.Module):
    """Pools each closed window of ``rate`` tokens into one entry of width ``dim``: per channel, a softmax over
    the window's gates (plus a learned bias per window offset) weights its projected values; then RMSNorm and
    the compress rotary at the window's first position. ``overlap``: projections are two series of ``dim``
    channels and an entry pools the previous window's first series with its own second (2 * rate slots).

    Per-request state (slots bound by the model runner): the open window's projections and, with ``overlap``,
    the first series of the last closed window.
    """

    def __init__(self, config: Any, dim: int, rate: int, overlap: bool, rotary: InterleavedRotary) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap, self.width = dim, rate, overlap, width
        self.kv_proj = ReplicatedLinear(config.hidden_size, width)
        self.gate_proj = ReplicatedLinear(config.hidden_size, width)
        self.position_bias = nn.Parameter(torch.empty(rate, width, dtype=torch.float32), requires_grad=False)
        self.kv_norm = Fp32RMSNorm(dim, config.rms_norm_eps)
        self.rotary = rotary
        self.open_kv = self.open_gate = self.overlap_kv = self.overlap_gate = torch.empty(0)

    def state_specs(self, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-slot shape and dtype of each state tensor (float32: the gates carry the float32 bias)."""
        specs = {"open_kv": ((self.rate, self.width), torch.float32),
                 "open_gate": ((self.rate, self.width), torch.float32)}
        if self.overlap:
            specs.update(overlap_kv=((self.rate, self.dim), torch.float32),
                         overlap_gate=((self.rate, self.dim), torch.float32))
        return specs

    def pool(self, hidden: torch.Tensor, slot: int, start: int, checkpoint: int = -1) -> tuple[int, torch.Tensor]:
        """One sequence's new tokens ``hidden`` [t, H] from position ``start``: (index of the first window closed
        now, the entries [n, dim] of the windows closed now); the slot's state carried over. ``checkpoint`` >= 0
        (a verify chunk of speculative decoding): the tokens are pooled one at a time and the state after each
        but the last is copied to slots ``checkpoint``, ``checkpoint + 1``, ... (the engine rolls ``slot`` back to
        the one after the last accepted position)."""
        kv, gate = self.kv_proj(hidden).float(), self.gate_proj(hidden).float()
        if checkpoint < 0:
            return self._pool(kv, gate, slot, start)
        parts = []
        for row in range(kv.shape[0]):
            parts.append(self._pool(kv[row:row + 1], gate[row:row + 1], slot, start + row)[1])
            if row < kv.shape[0] - 1:
                for name in self.state_names():
                    state = getattr(self, name)
                    state[checkpoint + row].copy_(state[slot])
        return start // self.rate, torch.cat(parts)

    def state_names(self) -> tuple[str, ...]:
        return ("open_kv", "open_gate") + (("overlap_kv", "overlap_gate") if self.overlap else ())

    def pool_rows(self, hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                  block_size: int, cache: torch.Tensor, grid: AttentionMetadata | None = None) -> None:
        """``pool`` for rows of one new token each (``hidden`` [R, H] at ``positions``, in state ``slots``), each
        joining its sequence's open window; the windows they close are pooled and paged into ``cache`` at their
        entry index, through the row's ``tables``. Nothing here depends on the host (a CUDA graph replays it).
        With ``grid`` (a grid step's metadata, ``grid_real`` set) the rows are pooled one position of every
        sequence at a time, and after each the states are copied to the rows' ``grid_checkpoints``."""
        kv, gate = self.kv_proj(hidden).float(), self.gate_proj(hidden).float()
        if grid is None or grid.grid_real is None:
            self._pool_pass(kv, gate, positions, slots, tables, block_size, cache, None)
            return
        width = grid.grid_len
        for j in range(width):
            rows = slice(j, None, width)
            self._pool_pass(kv[rows], gate[rows], positions[rows], slots[rows], tables[rows], block_size, cache,
                            grid.grid_real[rows])
            if width > 1:
                for name in self.state_names():
                    state = getattr(self, name)
                    state[grid.grid_checkpoints[rows]] = state[slots[rows]]

    def _pool_pass(self, kv: torch.Tensor, gate: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                   tables: torch.Tensor, block_size: int, cache: torch.Tensor, real: torch.Tensor | None) -> None:
        """One position of each sequence (projected rows ``kv``, ``gate`` [B, width], float32; ``real`` None: all
        rows are real): every row pools its window and pages the entry, also where the window stays open (that
        entry is not read until its window closes and overwrites it); only real rows that close a window move
        their overlap state on, and a row that is not real writes back the entry there."""
        held = positions % self.rate
        self.open_kv[slots, held] = kv
        self.open_gate[slots, held] = gate
        window = positions // self.rate
        kv, gate = self.open_kv[slots], self.open_gate[slots] + self.position_bias   # [B, rate, width]
        if self.overlap:
            closing = held == self.rate - 1
            # (A row that is not real would only set the overlap state to what its real row set: masked for clarity.)
            kv, gate = self._overlap_rows(kv, gate, slots, window, closing if real is None else closing & real)
        weights = torch.softmax(gate, dim=1, dtype=torch.float32)
        entries = self.rotary(self.kv_norm((kv * weights).sum(dim=1)), window * self.rate)
        target = table_slots(tables, window[:, None], block_size).squeeze(1)
        if real is not None:
            entries = torch.where(real[:, None], entries, read_rows(cache, target).float())
        write_rows(cache, target, entries)

    def _overlap_rows(self, kv: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor, window: torch.Tensor,
                      closing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_with_overlap`` for one window per row (rows of different sequences) whose index is ``window``
        [B]; only the ``closing`` rows' states move on."""
        dim = self.dim
        first = (window == 0)[:, None, None]
        held_kv, held_gate = self.overlap_kv[slots], self.overlap_gate[slots]
        previous_kv = torch.where(first, 0.0, held_kv)
        previous_gate = torch.where(first, float("-inf"), held_gate)
        moves = closing[:, None, None]
        self.overlap_kv[slots] = torch.where(moves, kv[:, :, :dim], held_kv)
        self.overlap_gate[slots] = torch.where(moves, gate[:, :, :dim], held_gate)
        return (torch.cat((previous_kv, kv[..., dim:]), dim=1), torch.cat((previous_gate, gate[..., dim:]), dim=1))

    def _pool(self, kv: torch.Tensor, gate: torch.Tensor, slot: int, start: int) -> tuple[int, torch.Tensor]:
        """``pool`` of projected rows ``kv``, ``gate`` [t, width] (float32)."""
        held = start % self.rate
        if held:
            kv = torch.cat((self.open_kv[slot, :held], kv))
            gate = torch.cat((self.open_gate[slot, :held], gate))
        first = start // self.rate
        windows = kv.shape[0] // self.rate
        used = windows * self.rate
        left = kv.shape[0] - used
        self.open_kv[slot, :left] = kv[used:]
        self.open_gate[slot, :left] = gate[used:]
        if windows == 0:
            return first, kv.new_zeros(0, self.dim)
        kv = kv[:used].view(windows, self.rate, self.width)
        gate = gate[:used].view(windows, self.rate, self.width) + self.position_bias
        if self.overlap:
            kv, gate = self._with_overlap(kv, gate, slot, first)
        weights = torch.softmax(gate, dim=1, dtype=torch.float32)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        positions = (torch.arange(windows, device=kv.device) + first) * self.rate
        return first, self.rotary(entries, positions)

    def _with_overlap(self, kv: torch.Tensor, gate: torch.Tensor, slot: int,
                      first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[W, 2 * rate, dim] slots: the previous window's first series (none before window 0), then this
        window's second series; the state keeps the last window's first series."""
        dim = self.dim
        previous_kv = torch.cat((self.overlap_kv[slot][None], kv[:-1, :, :dim]))
        previous_gate = torch.cat((self.overlap_gate[slot][None], gate[:-1, :, :dim]))
        if first == 0:   # window 0 has no predecessor: its first half weighs nothing
            previous_kv[0], previous_gate[0] = 0.0, float("-inf")
        self.overlap_kv[slot] = kv[-1, :, :dim]
        self.overlap_gate[slot] = gate[-1, :, :dim]
        return (torch.cat((previous_kv, kv[..., dim:]), dim=1), torch.cat((previous_gate, gate[..., dim:]), dim=1))


class IndexerScorer(nn.Module):
    """Per-token weights of the indexer's query heads."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.weights_proj = ReplicatedLinear(config.hidden_size, config.index_n_heads)


class Indexer(WindowPool):
    """Lightning indexer: pooled keys at ``index_head_dim`` (paged in ``keys``) scored against ReLU'd query
    heads, ``sum_h w_h * relu(q_h . k) / sqrt(c)``; keeps the ``index_topk`` best visible entries per query."""

    def __init__(self, config: Any, rate: int, rotary: InterleavedRotary) -> None:
        super().__init__(config, config.index_head_dim, rate, True, rotary)
        self.heads, self.topk = config.index_n_heads, config.index_topk
        self.q_b_proj = ReplicatedLinear(config.q_lora_rank, self.heads * self.dim)
        self.scorer = IndexerScorer(config)
        # The paged store of the pooled keys (the value half is unused).
        self.keys = Attention(self.heads, self.dim, 1, self.dim ** -0.5)

    def select(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, start: int, slot: int,
               table: torch.Tensor, block_size: int, visible: torch.Tensor, checkpoint: int = -1) -> torch.Tensor:
        """Which of the visible entries [t, n] each query keeps (bool [t, n]); ``start``: the first position (a
        host copy of ``positions[0]``). ``checkpoint``: ``pool``'s."""
        first, entries = self.pool(hidden, slot, start, checkpoint)
        if entries.shape[0]:
            index = torch.arange(first, first + entries.shape[0], device=hidden.device)
            write_rows(self.keys.k_cache, cache_slots(table, index, block_size), entries)
        count = visible.shape[1]
        if count == 0:
            return visible
        keys = read_rows(self.keys.k_cache, cache_slots(table, torch.arange(count, device=hidden.device),
                                                         block_size)).float()
        q = self.q_b_proj(q_residual).view(-1, self.heads, self.dim)
        q = self.rotary(q, positions).float()
        scores = F.relu(torch.einsum("thc,nc->thn", q, keys)) * self.dim ** -0.5
        weights = self.scorer.weights_proj(hidden).float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
        picked = scores.topk(min(self.topk, count), dim=-1).indices
        chosen = torch.zeros_like(visible).scatter_(1, picked, True)
        return chosen & visible


    def select_rows(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                    slots: torch.Tensor, tables: torch.Tensor, block_size: int, counts: torch.Tensor,
                    visible: torch.Tensor | None, grid: AttentionMetadata | None = None) -> torch.Tensor | None:
        """``select`` for a decode step (one query per sequence): which of each sequence's ``counts`` entries
        (``visible`` [B, n], None: none yet) its query keeps."""
        self.pool_rows(hidden, positions, slots, tables, block_size, self.keys.k_cache, grid)
        if visible is None:
            return None
        keys, _ = entries_of_rows(self.keys.k_cache, tables, counts, visible.shape[1], block_size)
        q = self.rotary(self.q_b_proj(q_residual).view(-1, self.heads, self.dim), positions).float()
        scores = F.relu(torch.einsum("bhc,bnc->bhn", q, keys.float())) * self.dim ** -0.5
        weights = self.scorer.weights_proj(hidden).float() * self.heads ** -0.5
        scores = (scores * weights.unsqueeze(-1)).sum(dim=1).masked_fill(~visible, float("-inf"))
        picked = scores.topk(min(self.topk, visible.shape[1]), dim=-1).indices
        return torch.zeros_like(visible).scatter_(1, picked, True) & visible


class Compressor(WindowPool):
    """The compressed branch of a CSA (``indexer`` set, overlapping windows) or HCA layer."""

    def __init__(self, config: Any, layer_type: str, rotary: InterleavedRotary) -> None:
        rate = int(config.compress_rates[layer_type])
        super().__init__(config, config.head_dim, rate, layer_type == CSA, rotary)
        self.indexer = Indexer(config, rate, rotary) if layer_type == CSA else None

    def history(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor, start: int,
                slot: int, table: torch.Tensor, block_size: int, cache: torch.Tensor,
                checkpoint: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's chunk from position ``start`` (the host's copy of ``positions[0]``): new entries pooled
        and paged into ``cache``; returns every entry of the sequence so far [n, D] and which of them each query
        attends (bool [t, n]). ``checkpoint``: ``pool``'s."""
        first, entries = self.pool(hidden, slot, start, checkpoint)
        if entries.shape[0]:
            index = torch.arange(first, first + entries.shape[0], device=hidden.device)
            write_rows(cache, cache_slots(table, index, block_size), entries)
        count = (start + hidden.shape[0]) // self.rate
        index = torch.arange(count, device=hidden.device)
        history = read_rows(cache, cache_slots(table, index, block_size))
        visible = index[None, :] < ((positions + 1) // self.rate)[:, None]
        if self.indexer is not None:
            visible = self.indexer.select(hidden, q_residual, positions, start, slot, table, block_size, visible,
                                          checkpoint)
        return history, visible


    def history_rows(self, hidden: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor,
                     longest: int, slots: torch.Tensor, tables: torch.Tensor, block_size: int,
                     cache: torch.Tensor, grid: AttentionMetadata | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``history`` for a decode step (one new token per sequence at ``positions``, none of whose contexts
        exceeds ``longest`` tokens): every sequence's entries so far, padded to those of a ``longest`` context
        ([B, n, D]), and which of them its query attends ([B, n]); (None, None) while that is none."""
        self.pool_rows(hidden, positions, slots, tables, block_size, cache, grid)
        counts = (positions + 1) // self.rate
        history, visible = entries_of_rows(cache, tables, counts, longest // self.rate, block_size)
        if self.indexer is not None:
            visible = self.indexer.select_rows(hidden, q_residual, positions, slots, tables, block_size, counts,
                                               visible, grid)
        return history, visible


# -------------------------------------------------------------------------------------------------- attention

class DeepseekV4Attention(nn.Module):
    """Shared-KV multi-query attention over the sliding window and the compressed history, with sinks."""

    def __init__(self, config: Any, layer_type: str, rotary: dict[str, InterleavedRotary]) -> None:
        super().__init__()
        heads, dim = config.num_attention_heads, config.head_dim
        self.heads, self.dim, self.eps = heads, dim, config.rms_norm_eps
        self.window = checked_window(config)
        self.q_a_proj = ReplicatedLinear(config.hidden_size, config.q_lora_rank)
        self.q_a_norm = Fp32RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = ReplicatedLinear(config.q_lora_rank, heads * dim)
        self.kv_proj = ReplicatedLinear(config.hidden_size, dim)
        self.kv_norm = Fp32RMSNorm(dim, config.rms_norm_eps)
        self.o_a_proj = GroupedLinear(heads * dim // config.o_groups, config.o_groups * config.o_lora_rank,
                                      config.o_groups)
        self.o_b_proj = ReplicatedLinear(config.o_groups * config.o_lora_rank, config.hidden_size)
        self.sinks = nn.Parameter(torch.empty(heads, dtype=torch.float32), requires_grad=False)
        self.rotary = rotary["main" if layer_type == SLIDING else "compress"]
        # Raw keys in the key half of the paged cache; compressed entries (by entry index) in the value half.
        self.attn = Attention(heads, dim, 1, dim ** -0.5, self.window)
        self.compressor = None if layer_type == SLIDING else Compressor(config, layer_type, rotary["compress"])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = hidden.shape[0]
        q_residual = self.q_a_norm(self.q_a_proj(hidden))
        q = rms_normalize(self.q_b_proj(q_residual).view(tokens, self.heads, self.dim), self.eps)
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        q = self.rotary.rotate(q, cos, sin)
        kv = self.rotary.rotate(self.kv_norm(self.kv_proj(hidden)), cos, sin)
        # Every row has a slot: this model runs the reference step, never a CUDA graph's padding rows (slot -1).
        write_rows(self.attn.k_cache, meta.slot_mapping, kv)
        if meta.is_decode_only and meta.state_checkpoints_host is None:
            out = self._decode_rows(q, q_residual, hidden, positions, meta)
        else:
            out = self._sequences(q, q_residual, hidden, positions, meta)
        out = self.rotary.rotate(out, cos, -sin)   # undo the values' rotation at the query's position
        return self.o_b_proj(self.o_a_proj(out.reshape(tokens, -1)))

    def _decode_rows(self, q: torch.Tensor, q_residual: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """A decode step (one query per sequence, no verify chunk; or a grid of short chunks, one query a row):
        every row at once, windows and histories padded to the longest context the host lists (a CUDA graph's
        capture lists its context bucket there; nothing else here reads the host) → [B, H, D]."""
        tables, block_size = meta.block_tables, meta.block_size
        history = visible = None
        if self.compressor is not None:
            history, visible = self.compressor.history_rows(hidden, q_residual, positions, max(meta.context_lens),
                                                            meta.state_slots, tables, block_size,
                                                            self.attn.v_cache, meta)
        offsets = torch.arange(1 - self.window, 1, device=q.device)
        key_positions = positions[:, None] + offsets[None, :]                       # [B, window]
        allowed = key_positions >= 0
        slots = table_slots(tables, key_positions.clamp(min=0), block_size)
        keys = read_rows(self.attn.k_cache, slots.flatten()).view(q.shape[0], self.window, -1).to(q.dtype)
        if history is not None:
            keys = torch.cat((keys, history.to(q.dtype)), dim=1)
            allowed = torch.cat((allowed, visible), dim=1)
        logits = torch.einsum("bhd,bkd->bhk", q, keys) * self.dim ** -0.5
        logits = logits.masked_fill(~allowed[:, None, :], float("-inf"))
        sinks = self.sinks.to(logits.dtype)[None, :, None].expand(q.shape[0], -1, 1)
        logits = torch.cat((logits, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("bhk,bkd->bhd", probs.to(keys.dtype), keys)

    def _sequences(self, q: torch.Tensor, q_residual: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata) -> torch.Tensor:
        """Any step, one sequence's chunk at a time → [T, H, D]."""
        outputs = []
        for i in range(meta.num_seqs):
            begin, end = meta.query_start[i], meta.query_start[i + 1]
            if begin == end:
                continue
            start = meta.context_lens[i] - (end - begin)   # positions[begin], known on the host
            table = meta.block_tables[i]
            history = visible = None
            if self.compressor is not None:
                slot = meta.state_slots_host[i]
                checkpoints = meta.state_checkpoints_host
                history, visible = self.compressor.history(hidden[begin:end], q_residual[begin:end],
                                                           positions[begin:end], start, slot, table, meta.block_size,
                                                           self.attn.v_cache, -1 if checkpoints is None
                                                           else checkpoints[i])
            outputs.append(self._attend(q[begin:end], positions[begin:end], start, table, meta.block_size,
                                        history, visible))
        return torch.cat(outputs) if outputs else q.new_zeros(0, self.heads, self.dim)

    def _attend(self, q: torch.Tensor, positions: torch.Tensor, first: int, table: torch.Tensor, block_size: int,
                history: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor:
        """One sequence's queries [t, H, D] at ``positions`` (the first, ``first``, known on the host) over its
        window's raw keys and its visible history, plus sinks."""
        last = first + q.shape[0] - 1
        key_positions = torch.arange(max(0, first - self.window + 1), last + 1, device=q.device)
        keys = read_rows(self.attn.k_cache, cache_slots(table, key_positions, block_size)).to(q.dtype)
        offset = positions[:, None] - key_positions[None, :]
        allowed = (offset >= 0) & (offset < self.window)
        values = keys
        if history is not None and history.shape[0]:
            history = history.to(q.dtype)
            keys = values = torch.cat((keys, history))
            allowed = torch.cat((allowed, visible), dim=1)
        scale = self.dim ** -0.5
        logits = torch.einsum("thd,kd->htk", q, keys) * scale
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        sinks = self.sinks.to(logits.dtype)[:, None, None].expand(-1, q.shape[0], 1)
        logits = torch.cat((logits, sinks), dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("htk,kd->thd", probs.to(values.dtype), values)
