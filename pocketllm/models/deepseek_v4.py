"""DeepSeek-V4: shared-KV attention over a sliding window plus compressed history, hyper-connections, hashed and
routed mixtures of experts — as transformers' ``DeepseekV4ForCausalLM`` computes it.

The layer
    The residual is ``hc_mult`` parallel streams per token ([T, hc, D]). Before each of the two blocks (attention,
    feed-forward) a hyper-connection reads all streams (unweighted RMSNorm of the flattened streams, one linear
    map, then sigmoid / sigmoid / softmax heads): ``pre`` collapses the streams into the block's input, ``post``
    spreads the block's output back over the streams, and ``comb`` — made doubly stochastic by Sinkhorn-Knopp
    iterations — mixes the incoming streams into the outgoing ones. A final hyper-head collapses the streams
    before the last norm and the LM head.

Attention (one KV head read as both key and value; per-head learnable sink logits)
    ``q = q_b(rmsnorm(q_a(x)))`` with an unweighted per-head RMSNorm, ``kv = rmsnorm(kv_proj(x))``; interleaved
    rotary on the *last* ``qk_rope_head_dim`` channels of each head (``main`` rope for sliding layers,
    ``compress`` rope for compressed ones); scale ``head_dim ** -0.5``. Each query attends the raw keys of the
    last ``sliding_window`` positions and, on compressed layers, compressed history entries:

    * heavily compressed (HCA): every ``m'`` tokens pooled into one entry (per-channel softmax over the window's
      gates plus a learned position bias, then RMSNorm and rotary at the window's first position);
    * compressed sparse (CSA): entries pooled over ``2m`` tokens with stride ``m`` (the previous window's first
      half of the channels with this window's second half), and a lightning indexer — its own pooled keys at
      ``index_head_dim``, ``index_n_heads`` ReLU-scored query heads weighted per token — keeps the
      ``index_topk`` best entries per query.

    Query ``p`` may see entry ``w`` once its window is closed: ``w < (p + 1) // m``. The rotary of the value
    path is undone on the output (rotation by ``-p``) before the grouped low-rank output projection
    (``o_groups`` block-diagonal maps to ``o_lora_rank``, then ``o_b_proj``).

Feed-forward
    Routed experts plus one shared expert, SwiGLU with the gate clamped at ``swiglu_limit`` and the up
    projection clamped to ``±swiglu_limit``. Router scores ``sqrt(softplus(logits))`` (or sigmoid): "moe"
    layers take the top-k of scores plus a correction bias, "hash_moe" layers take the experts
    ``tid2eid[token]`` fixes; the chosen scores are renormalised and scaled by ``routed_scaling_factor``.

Where the per-request state lives
    * Raw keys (K = V) of every layer go in the paged KV cache through the layer's ``Attention`` (sliding
      window set), addressed by token position as for any model.
    * Compressed entries are history, not a ring: they also live in the paged cache, addressed by *entry index*
      — entry ``w`` of a sequence sits in the cache slot of that sequence's token ``w`` (there are never more
      entries than tokens, so the blocks the sequence already holds cover them). The main compressor's entries
      go in the value half of the layer's own cache (unused otherwise, since K = V); the indexer's keys in a
      second ``Attention`` cache of ``index_head_dim``. This relies on the block manager keeping the blocks of
      positions outside the window allocated, as it does.
    * What cannot be paged — the projections of the tokens of a window not yet closed (at most ``m - 1``
      tokens) and, for CSA and its indexer, the first half of the channels of the last closed window (the next
      entry's overlap) — sits in per-request state slots, as the recurrent state of Qwen3.5's DeltaNet
      layers does (``state_specs``). A sequence that starts at position 0 starts from empty state; prefix
      caching is therefore off for this model (a cached prefix would lack that state), while chunked prefill
      and preemption (recompute) keep it consistent.

Runs on the PyTorch reference step on CPU and on CUDA (``kernel_step = False``: no CPU decode plan, no Triton
attention or decode CUDA graphs, since its attention is its own; plain torch ops on the device, in the engine's
dtype), on one rank. The multi-token-prediction layer (``mtp.*``) is loaded only when the model runner adds it
(``add_mtp_head``, speculative ``method="mtp"``: ``deepseek_v4_mtp.py``), else skipped. Config features
transformers' reference does not compute, or that we do not, are refused at load by name.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

from pocketllm.distributed import tp_size
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.kernels import available as kernels_available
from pocketllm.layers.attention import Attention
from pocketllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pocketllm.layers.linear import ReplicatedLinear
from pocketllm.layers.moe import FusedMoE
from pocketllm.models.windows import checked_window
from pocketllm.step.attention_metadata import AttentionMetadata

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
HASH_MOE, MOE = "hash_moe", "moe"
SCORING = {"sqrtsoftplus": lambda x: F.softplus(x).sqrt(), "sigmoid": torch.sigmoid}
SKIPPED_PREFIXES = ("mtp.", "model.mtp.")
# DeepSeek's checkpoint names → transformers' module names (ours), in order; each leaves the latter unchanged.
# Per-expert w1 / w3 / w2 become gate / up / down projections, which the loader stacks into the FusedMoE.
UPSTREAM_RENAMES = tuple((re.compile(pattern), replacement) for pattern, replacement in (
    (r"^embed\.", "embed_tokens."), (r"^head\.", "lm_head."), (r"^hc_head_(fn|base|scale)$", r"hc_head.hc_\1"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_(attn|ffn)_(fn|base|scale)$", r".\1_hc.\2"),
    (r"\.attn\.indexer\.compressor\.", ".attn.compressor.indexer."),
    (r"\.attn\.indexer\.wq_b\.", ".attn.compressor.indexer.q_b_proj."),
    (r"\.attn\.indexer\.weights_proj\.", ".attn.compressor.indexer.scorer.weights_proj."),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.attn_sink$", ".sinks"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.q_norm\.", ".q_a_norm."), (r"\.wq_b\.", ".q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."),
    (r"\.wo_b\.", ".o_b_proj."), (r"\.ape$", ".position_bias"), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.(shared_experts|experts\.\d+)\.w1\.", r".\1.gate_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w3\.", r".\1.up_proj."),
    (r"\.(shared_experts|experts\.\d+)\.w2\.", r".\1.down_proj."),
))
MTP_LAYER = re.compile(r"^mtp\.(?:layers\.)?(\d+)\.")


def _mtp_name(name: str) -> str:
    """An MTP layer's entry (``mtp.N.`` or ``mtp.layers.N.``) as ``mtp.layers.N.``, its own hyper-head named as
    the model's; refused for the compressor of a compressed MTP layer and the table of a hash-routed one, which ours
    are not."""
    if re.search(r"\.(compressor|indexer)\.", name):
        raise UnsupportedFeatureError(f"speculative_config.method 'mtp': this checkpoint's MTP layer compresses its "
                                      f"attention ({name}); PocketLLM runs a sliding-window MTP layer")
    if name.endswith(".tid2eid"):
        raise UnsupportedFeatureError(f"speculative_config.method 'mtp': this checkpoint's MTP layer routes its "
                                      f"experts by token hash ({name}); PocketLLM runs a score-routed MTP layer")
    name = MTP_LAYER.sub(r"mtp.layers.\1.", name)
    return re.sub(r"\.hc_head_(fn|base|scale)$", r".hc_head.hc_\1", name)


# ----------------------------------------------------------------------------------------------- config checks

def _layer_types(config: Any) -> list[str]:
    types = list(config.layer_types)
    unknown = sorted(set(types) - {SLIDING, CSA, HCA})
    if len(types) != config.num_hidden_layers or unknown:
        raise UnsupportedFeatureError(f"layer_types {unknown or types} are not supported for DeepSeek-V4")
    return types


def check_supported(config: Any) -> None:
    """Refuse, by name, a config feature this model does not compute as the config asks."""
    def refuse(feature: str) -> NoReturn:
        raise UnsupportedFeatureError(f"{feature} is not supported for DeepSeek-V4")

    if tp_size() != 1:
        refuse("tensor parallelism")
    if getattr(config, "quantization_config", None):
        refuse("quantization_config (quantized checkpoints)")
    if getattr(config, "num_key_value_heads", 1) != 1:
        refuse(f"num_key_value_heads={config.num_key_value_heads} (the attention has one shared KV head)")
    if getattr(config, "attention_bias", False):
        refuse("attention_bias")
    if getattr(config, "mlp_bias", False):
        refuse("mlp_bias")
    if getattr(config, "hidden_act", "silu") != "silu":
        refuse(f"hidden_act {config.hidden_act!r}")
    if getattr(config, "scoring_func", "sqrtsoftplus") not in SCORING:
        refuse(f"scoring_func {config.scoring_func!r}")
    if not getattr(config, "norm_topk_prob", True):
        refuse("norm_topk_prob=False (the reference always renormalises the chosen experts' weights)")
    if getattr(config, "n_shared_experts", 1) != 1:
        refuse(f"n_shared_experts={config.n_shared_experts} (the reference builds exactly one shared expert)")
    if getattr(config, "tie_word_embeddings", False):
        refuse("tie_word_embeddings")
    unknown = sorted(set(config.mlp_layer_types) - {HASH_MOE, MOE})
    if unknown or len(config.mlp_layer_types) != config.num_hidden_layers:
        refuse(f"mlp_layer_types {unknown or list(config.mlp_layer_types)}")
    types = _layer_types(config)
    for kind in (CSA, HCA):
        if kind in types and int(config.compress_rates[kind]) < 1:
            refuse(f"compress_rates[{kind!r}]={config.compress_rates[kind]}")
    if checked_window(config) is None:
        refuse("sliding_window=None (every DeepSeek-V4 layer slides)")
    rope_dim = int(config.qk_rope_head_dim)
    if rope_dim % 2 or rope_dim > config.head_dim or (CSA in types and rope_dim > config.index_head_dim):
        refuse(f"qk_rope_head_dim={rope_dim} with head_dim={config.head_dim}, index_head_dim={config.index_head_dim}")
    if (config.num_attention_heads * config.head_dim) % config.o_groups:
        refuse(f"o_groups={config.o_groups} not dividing the attention heads")
    for label in ("main", "compress"):
        kind = _rope_params(config, label).get("rope_type", "default")
        if kind not in ("default", "yarn") or (label == "main" and kind != "default"):
            refuse(f"rope_parameters[{label!r}] rope_type {kind!r}")


def _rope_params(config: Any, label: str) -> dict[str, Any]:
    return dict((getattr(config, "rope_parameters", None) or {}).get(label) or {})


# -------------------------------------------------------------------------------------------------- arithmetic

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


def entries_of_rows(cache: torch.Tensor, tables: torch.Tensor, counts: list[int],
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Each sequence's first ``counts[b]`` paged entries, padded to the most: rows [B, n, D] and which are real
    (bool [B, n]); (None, None) when no sequence has one."""
    most = max(counts)
    if most == 0:
        return None, None
    device = tables.device
    index = torch.arange(most, device=device)[None, :].expand(len(counts), -1)
    real = index < torch.tensor(counts, device=device)[:, None]
    rows = read_rows(cache, table_slots(tables, index, block_size).flatten())
    return rows.view(len(counts), most, -1), real


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

    def pool_rows(self, hidden: torch.Tensor, positions: list[int], slots: list[int], tables: torch.Tensor,
                  block_size: int, cache: torch.Tensor) -> None:
        """``pool`` for a decode step: one new token per sequence (``hidden`` [B, H], host ``positions`` and state
        ``slots``), each joining its sequence's open window; the windows they close are pooled and paged into
        ``cache`` at their entry index, through the sequence's row of ``tables``."""
        kv, gate = self.kv_proj(hidden).float(), self.gate_proj(hidden).float()
        device = hidden.device
        slot = torch.tensor(slots, device=device)
        held = torch.tensor([p % self.rate for p in positions], device=device)
        self.open_kv[slot, held] = kv
        self.open_gate[slot, held] = gate
        closing = [b for b, p in enumerate(positions) if p % self.rate == self.rate - 1]
        if not closing:
            return
        rows = torch.tensor(closing, device=device)
        windows = [positions[b] // self.rate for b in closing]
        kv, gate = self.open_kv[slot[rows]], self.open_gate[slot[rows]] + self.position_bias   # [c, rate, width]
        if self.overlap:
            kv, gate = self._overlap_rows(kv, gate, slot[rows], windows)
        weights = torch.softmax(gate, dim=1, dtype=torch.float32)
        window = torch.tensor(windows, device=device)
        entries = self.rotary(self.kv_norm((kv * weights).sum(dim=1)), window * self.rate)
        write_rows(cache, table_slots(tables[rows], window[:, None], block_size).squeeze(1), entries)

    def _overlap_rows(self, kv: torch.Tensor, gate: torch.Tensor, slots: torch.Tensor,
                      windows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``_with_overlap`` for one closing window per row (rows of different sequences)."""
        dim = self.dim
        first = torch.tensor([w == 0 for w in windows], device=kv.device)[:, None, None]
        previous_kv = torch.where(first, 0.0, self.overlap_kv[slots])
        previous_gate = torch.where(first, float("-inf"), self.overlap_gate[slots])
        self.overlap_kv[slots] = kv[:, :, :dim]
        self.overlap_gate[slots] = gate[:, :, :dim]
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
                    host_positions: list[int], slots: list[int], tables: torch.Tensor, block_size: int,
                    counts: list[int], visible: torch.Tensor | None) -> torch.Tensor | None:
        """``select`` for a decode step (one query per sequence): which of each sequence's ``counts`` entries
        (``visible`` [B, n], None: none yet) its query keeps."""
        self.pool_rows(hidden, host_positions, slots, tables, block_size, self.keys.k_cache)
        if visible is None:
            return None
        keys, _ = entries_of_rows(self.keys.k_cache, tables, counts, block_size)
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
                     host_positions: list[int], slots: list[int], tables: torch.Tensor, block_size: int,
                     cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """``history`` for a decode step (one new token per sequence, at host ``positions``): every sequence's
        entries so far, padded ([B, n, D]), and which of them its query attends ([B, n]); (None, None) while no
        sequence has closed a window."""
        self.pool_rows(hidden, host_positions, slots, tables, block_size, cache)
        counts = [(p + 1) // self.rate for p in host_positions]
        history, visible = entries_of_rows(cache, tables, counts, block_size)
        if self.indexer is not None:
            visible = self.indexer.select_rows(hidden, q_residual, positions, host_positions, slots, tables,
                                               block_size, counts, visible)
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
        """A decode step (one query per sequence, no verify chunk): every sequence at once, windows and
        histories padded to the longest → [B, H, D]."""
        host_positions = [length - 1 for length in meta.context_lens]
        tables, block_size = meta.block_tables, meta.block_size
        history = visible = None
        if self.compressor is not None:
            history, visible = self.compressor.history_rows(hidden, q_residual, positions, host_positions,
                                                            meta.state_slots_host, tables, block_size,
                                                            self.attn.v_cache)
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


# ------------------------------------------------------------------------------------------------------ model

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


class DeepseekV4ForCausalLM(nn.Module):
    """Embedding expanded to ``hc_mult`` streams, the decoder layers, the hyper-head, final norm and LM head."""

    # On CUDA the model runner runs the reference step (this attention is not the Triton kernels').
    kernel_step = False
    supports_mtp = True     # the checkpoint may carry an MTP layer (``add_mtp_head``)

    def __init__(self, config: Any) -> None:
        super().__init__()
        check_supported(config)
        self.config = config
        self.tie_word_embeddings = False
        self.streams = config.hc_mult
        rope_dim = int(config.qk_rope_head_dim)
        self.rotary = nn.ModuleDict({label: InterleavedRotary(rope_dim, _rope_params(config, label))
                                     for label in ("main", "compress")})
        rotary = dict(self.rotary.items())
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, kind, mlp, rotary)
                                    for kind, mlp in zip(_layer_types(config), config.mlp_layer_types))
        self.hc_head = HyperHead(config)
        self.norm = Fp32RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.sliding_windows = [layer.self_attn.window for layer in self.layers]
        self.mtp: nn.Module | None = None
        # With the MTP layer: the last decoder layer's streams [T, hc, D] of every row of the last forward.
        self.mtp_target_hidden: torch.Tensor | None = None

    def add_mtp_head(self) -> None:
        """Build the MTP layer (``self.mtp``) for speculative ``method="mtp"``, under the caller's device and
        dtype; refused for a config without one MTP layer (``num_nextn_predict_layers``)."""
        from pocketllm.models.deepseek_v4_mtp import DeepseekV4MultiTokenPredictor

        self.mtp = DeepseekV4MultiTokenPredictor(self.config, dict(self.rotary.items()))

    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, target_hidden: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """The MTP layer's output streams at ``positions``, of ``input_ids`` (the tokens after them) and the
        target's (or the layer's own) streams there."""
        if self.mtp is None:
            raise RuntimeError("mtp_forward needs the MTP layer (add_mtp_head)")
        return self.mtp(self.embed_tokens(input_ids), target_hidden, input_ids, positions, meta)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head's logits of the MTP layer's output streams (through its own hyper-head and norm)."""
        if self.mtp is None:
            raise RuntimeError("mtp_logits needs the MTP layer (add_mtp_head)")
        return self.compute_logits(self.mtp.collapse(hidden))

    def decode_plan(self) -> None:
        """None: the CPU decode plan describes none of this architecture; it runs the reference path."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states after the hyper-head and the final norm."""
        hidden = self.embed_tokens(input_ids)
        streams = hidden.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, meta)
        if self.mtp is not None:
            self.mtp_target_hidden = streams
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def checkpoint_name(self, name: str) -> str | None:
        """Our parameter name for a checkpoint entry, in DeepSeek's own names (what published checkpoints and
        transformers' ``save_pretrained`` write) or transformers' module names; None for the MTP layer unless
        ``add_mtp_head`` built it (``mtp.0.*``, in DeepSeek's names, loads as ``mtp.layers.0.*``)."""
        if name.startswith(SKIPPED_PREFIXES) and self.mtp is None:
            return None
        name = name.removeprefix("model.")
        if name.startswith("mtp."):
            name = _mtp_name(name)
        for pattern, replacement in UPSTREAM_RENAMES:
            name = pattern.sub(replacement, name)
        if ".self_attn." in name:
            name = re.sub(r"\.norm\.weight$", ".kv_norm.weight", name)
        # Routed experts stored stacked (one tensor per layer), as FusedMoE holds them.
        if name.endswith(".mlp.experts.gate_up_proj"):
            return name.removesuffix("gate_up_proj") + "w13"
        if name.endswith(".mlp.experts.down_proj"):
            return name.removesuffix("down_proj") + "w2"
        return name
