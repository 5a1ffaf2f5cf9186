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

The attention, its compressors and indexer, rotary and norms are in ``deepseek_v4_attention.py``; the decoder
layer, hyper-connections and experts in ``deepseek_v4_blocks.py``. Runs on the PyTorch reference step on CPU and
on CUDA (``kernel_step = False``: no CPU decode plan and no Triton attention, since its attention is its own;
plain torch ops on the device, in the engine's dtype), on one rank. On CUDA its decode and verify steps replay
CUDA graphs of that step (``runner/reference_graphs.py``). The multi-token-prediction layer (``mtp.*``) is loaded
only when the model runner adds it (``add_mtp_head``, speculative ``method="mtp"``: ``deepseek_v4_mtp.py``),
else skipped. Config features transformers' reference does not compute, or that we do not, are refused at load
by name.
"""

from __future__ import annotations

import re
from typing import Any, NoReturn

import torch
from torch import nn

from pocketllm.distributed import tp_size
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pocketllm.models.deepseek_v4_attention import CSA, HCA, SLIDING, Fp32RMSNorm, InterleavedRotary
from pocketllm.models.deepseek_v4_blocks import HASH_MOE, MOE, SCORING, DeepseekV4DecoderLayer, HyperHead
from pocketllm.models.windows import checked_window
from pocketllm.step.attention_metadata import AttentionMetadata

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


# ------------------------------------------------------------------------------------------------------ model

class DeepseekV4ForCausalLM(nn.Module):
    """Embedding expanded to ``hc_mult`` streams, the decoder layers, the hyper-head, final norm and LM head."""

    # On CUDA the model runner runs the reference step (this attention is not the Triton kernels').
    kernel_step = False
    # Its decode step reads nothing from the host but the longest context (runner/reference_graphs.py).
    reference_decode_graphs = True
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
