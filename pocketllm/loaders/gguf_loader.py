"""GGUF files: a model config from the metadata, HF-named float32 tensors from the (quantised) data.

Facts this module relies on (llama.cpp's converter conventions):
- shapes are stored in ggml order (fastest dimension first); ``GGUFFile`` gives them reversed, which for a linear
  layer is HF's ``[out_features, in_features]``;
- for the ``llama`` architecture the converter permutes the rows of ``attn_q``/``attn_k`` (weight and bias)
  per head from HF's rotate-half layout to interleaved pairs; qwen2/qwen3/qwen3moe are stored unpermuted;
- Llama-3-style rope scaling is stored as a ``rope_freqs.weight`` tensor of per-frequency divisors, not as
  metadata; we recover the llama3 rope parameters from it (and check the recovery reproduces it);
- Qwen3-MoE experts are stacked ``[experts, out, in]`` tensors and llama.cpp normalises the top-k weights;
- Gemma 3 stores every RMSNorm weight as ``1 + w`` (the HF weight plus one), unpermuted q/k, no ``output``
  tensor (tied), and names its norms ``attn_norm`` / ``post_attention_norm`` / ``ffn_norm`` (the
  pre-feedforward norm) / ``post_ffw_norm``. llama.cpp fixes what the metadata does not say: every sixth layer
  attends fully, the sliding layers' rotary base is 10,000 unscaled, and the attention scale is
  ``(hidden / heads) ** -0.5`` for the 62-layer (27B) model, ``head_dim ** -0.5`` otherwise.
- Qwen3.5 (``qwen35``, dense) stores every RMSNorm but the DeltaNet's gated one as ``1 + w``; ``A_log`` as
  ``ssm_a = -exp(A_log)``; ``dt_bias`` as ``ssm_dt.bias``; the conv kernel squeezed to ``[channels, K]``; the
  query (with its per-head output gate) unpermuted. Where the DeltaNet has more value heads than key heads,
  the value heads are reordered from grouped by key head (``k0v0, k0v1, k1v0, ...``) to tiled (``k0v0, k1v0,
  k0v1, ...``) in every tensor that has them (the value rows of ``attn_qkv`` and of the conv kernel,
  ``attn_gate``, ``ssm_alpha``, ``ssm_beta``, ``ssm_a``, ``ssm_dt`` and the columns of ``ssm_out``); every
  ``full_attention_interval``-th layer attends fully; ``rope.dimension_count`` is the rotated part of a head.
- Qwen3.5-MoE (``qwen35moe``) is laid out as dense Qwen3.5, plus: the routed experts stacked ``[experts, out,
  in]`` as ``ffn_gate_exps`` / ``ffn_up_exps`` / ``ffn_down_exps`` (the checkpoint's fused gate-up tensor split
  in halves, gate first) or, written with the converter's gate-up fusion, ``ffn_gate_up_exps`` (gate rows then
  up rows); the router ``ffn_gate_inp``; the shared expert ``ffn_{gate,up,down}_shexp`` and its sigmoid gate
  ``ffn_gate_inp_shexp`` (a ``[hidden]`` or ``[1, hidden]`` row); ``expert_shared_feed_forward_length`` its width.
  The chosen experts' weights are always renormalised, as transformers does.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pocketllm.errors import CheckpointError
from pocketllm.loaders.gguf_dequant import check_type, dequantize
from pocketllm.loaders.gguf_file import GGUFFile, GGUFTensor
from pocketllm.loaders.model_config import ModelConfig

# GGUF general.architecture -> (transformers model_type, architectures[0])
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
    "qwen35": ("qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen35moe": ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
}
# Layer parts an architecture names differently from the Llama layout.
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    "gemma3": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "qwen35": {"post_attention_norm": "post_attention_layernorm", "attn_qkv": "linear_attn.in_proj_qkv",
               "attn_gate": "linear_attn.in_proj_z", "ssm_alpha": "linear_attn.in_proj_a",
               "ssm_beta": "linear_attn.in_proj_b", "ssm_conv1d": "linear_attn.conv1d",
               "ssm_a": "linear_attn.A_log", "ssm_dt": "linear_attn.dt_bias", "ssm_norm": "linear_attn.norm",
               "ssm_out": "linear_attn.out_proj"},
}
_ARCH_LAYER_NAMES["qwen35moe"] = {
    **_ARCH_LAYER_NAMES["qwen35"], "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_QWEN35_ARCHS = ("qwen35", "qwen35moe")
# Architectures whose norm weights llama.cpp stores as ``1 + w`` (Qwen3.5: all but the DeltaNet's gated norm).
_SHIFTED_NORMS = ("gemma3", *_QWEN35_ARCHS)
_UNSHIFTED_NORM_PARTS = ("ssm_norm",)
# Qwen3.5 tensors whose names carry no ``.weight``/``.bias`` of their own in the HF checkpoint.
_BARE_PARAMETERS = {("ssm_a", "weight"), ("ssm_dt", "bias")}
_GEMMA3_SLIDING_PATTERN = 6        # llama.cpp: layers 6k + 5 attend fully
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA3_27B_LAYERS = 62

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
}
_EXPERT_NAMES = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj",
                 "ffn_gate_up_exps": "gate_up_proj"}
_FUSED_EXPERTS = "ffn_gate_up_exps"   # [experts, 2 * width, hidden]: gate rows, then up rows
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_BARE_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.(ssm_a)$")   # llama.cpp names ssm_a without a suffix
_ROPE_FREQS = "rope_freqs.weight"
_LLAMA3_LOW_FREQ_FACTOR = 1.0  # Meta's published values for every Llama 3.x model
_LLAMA3_HIGH_FREQ_FACTOR = 4.0
_MISSING = object()


def open_gguf(path: str) -> GGUFFile:
    """The metadata and memory-mapped tensors of the GGUF file at ``path``."""
    return GGUFFile(path)


def metadata(reader: GGUFFile, key: str, default: Any = _MISSING) -> Any:
    """One metadata value as a Python object; ``default`` (or CheckpointError) when absent."""
    if key not in reader.metadata:
        if default is _MISSING:
            raise CheckpointError(f"GGUF metadata lacks {key!r}")
        return default
    return reader.metadata[key]


def architecture(reader: GGUFFile) -> str:
    """``general.architecture``, checked against the architectures PocketLLM runs."""
    arch = metadata(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch


def _uniform(value: Any, key: str) -> int:
    """A per-model integer that GGUF may also store per layer (then all layers must agree)."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"GGUF {key} varies per layer ({value}); not supported")
        value = value[0]
    return int(value)


def linear_weight_type(reader: GGUFFile) -> str | None:
    """The GGML type (e.g. ``"Q4_1"``) that holds most elements of the layers' matrices (``blk.*`` tensors of
    two or more dimensions), or None when the file has none."""
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and len(tensor.shape) >= 2:
            kind = tensor.type.name
            counts[kind] = counts.get(kind, 0) + tensor.n_elements
    return max(counts, key=counts.__getitem__) if counts else None


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of q/k (interleaved pairs back to rotate-half halves)."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    if num_heads * 2 * half != rows:
        raise CheckpointError(f"q/k rows ({rows}) are not a multiple of 2 x heads ({num_heads})")
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return np.ascontiguousarray(grouped.swapaxes(1, 2)).reshape(weight.shape)


def hf_name(gguf_name: str, arch: str = "llama") -> tuple[str, str | None]:
    """``(hf_name, part)`` for a GGUF tensor name of ``arch``; ``part`` is the GGUF layer part (``attn_q``...)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name], None
    match = _LAYER_TENSOR.match(gguf_name)
    bare = _BARE_LAYER_TENSOR.match(gguf_name)
    if bare:
        match, groups = bare, (*bare.groups(), "weight")
    elif match:
        groups = match.groups()
    if match:
        layer, part, suffix = groups
        names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
        if part in names:
            if (part, suffix) in _BARE_PARAMETERS:
                return f"model.layers.{layer}.{names[part]}", part
            return f"model.layers.{layer}.{names[part]}.{suffix}", part
        if part in _EXPERT_NAMES and suffix == "weight":
            return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[part]}.weight", part
    raise CheckpointError(f"GGUF tensor {gguf_name!r} has no known Hugging Face name")


def llama3_rope_factors(theta: float, head_dim: int, factor: float, low: float, high: float,
                        original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in ``rope_freqs.weight`` for llama3 rope scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, medium))


def _original_context(factors: np.ndarray, wavelen: np.ndarray, factor: float) -> int:
    """The llama3 ``original_max_position_embeddings`` implied by stored divisors (low=1, high=4 assumed)."""
    low, high = _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR
    medium = (factors > 1 + 1e-4) & (factors < factor * (1 - 1e-4))
    if medium.any():
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        return round(float(np.median((smooth * (high - low) + low) * wavelen[medium])))
    unscaled = wavelen[factors <= 1 + 1e-4]
    # No divisor in the smooth band: any context between the last unscaled and the first scaled wavelength
    # reproduces the tensor; take the smallest integer above the unscaled bound (checked by the caller).
    return math.floor(high * unscaled.max()) + 1 if unscaled.size else 1


def llama3_rope_from_factors(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover llama3 rope-scaling parameters from ``rope_freqs.weight`` (None when it scales nothing)."""
    factors = factors.astype(np.float64).reshape(-1)
    if factors.shape[0] != head_dim // 2:
        raise CheckpointError(f"rope_freqs has {factors.shape[0]} entries; expected head_dim/2 = {head_dim // 2}")
    factor = float(factors.max())
    if np.allclose(factors, 1.0):
        return None
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    original = _original_context(factors, wavelen, factor)
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": _LLAMA3_LOW_FREQ_FACTOR,
              "high_freq_factor": _LLAMA3_HIGH_FREQ_FACTOR, "original_max_position_embeddings": original}
    expected = llama3_rope_factors(theta, head_dim, factor, _LLAMA3_LOW_FREQ_FACTOR, _LLAMA3_HIGH_FREQ_FACTOR,
                                   original)
    if not np.allclose(expected, factors, rtol=1e-4, atol=1e-5):
        raise CheckpointError("rope_freqs.weight does not follow llama3 rope scaling; cannot express it")
    return params


def _rope_scaling(reader: GGUFFile, arch: str, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Rope scaling from metadata (linear/yarn) or from a ``rope_freqs`` tensor (llama3)."""
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if _ROPE_FREQS in tensors:
        return llama3_rope_from_factors(dequantize(tensors[_ROPE_FREQS]), theta, head_dim)
    kind = metadata(reader, f"{arch}.rope.scaling.type", None)
    factor = metadata(reader, f"{arch}.rope.scaling.factor", None)
    if kind is None and metadata(reader, f"{arch}.rope.scale_linear", None) is not None:
        kind, factor = "linear", metadata(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = metadata(reader, f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported")


def _special_ids(reader: GGUFFile) -> dict[str, Any]:
    """bos/eos/pad ids; eos lists every end-of-generation id llama.cpp would stop on (eos, eot, eom)."""
    ids: dict[str, Any] = {}
    bos = metadata(reader, "tokenizer.ggml.bos_token_id", None)
    pad = metadata(reader, "tokenizer.ggml.padding_token_id", None)
    stops = [metadata(reader, f"tokenizer.ggml.{kind}_token_id", None) for kind in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
    if bos is not None:
        ids["bos_token_id"] = int(bos)
    if pad is not None:
        ids["pad_token_id"] = int(pad)
    if stops:
        ids["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return ids


def _moe_params(reader: GGUFFile, arch: str) -> dict[str, Any]:
    """Qwen3-MoE expert settings (every layer sparse, as llama.cpp runs it)."""
    return {
        "num_experts": int(metadata(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(metadata(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(metadata(reader, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": bool(metadata(reader, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def build_config(reader: GGUFFile) -> ModelConfig:
    """The model config the GGUF metadata describes (what transformers would build from the same file)."""
    arch = architecture(reader)
    model_type, class_name = ARCHITECTURES[arch]
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise CheckpointError("GGUF file has no token_embd.weight tensor")
    hidden = int(metadata(reader, f"{arch}.embedding_length"))
    heads = _uniform(metadata(reader, f"{arch}.attention.head_count"), "head_count")
    kv_heads = _uniform(metadata(reader, f"{arch}.attention.head_count_kv", heads), "head_count_kv")
    head_dim = int(metadata(reader, f"{arch}.attention.key_length",
                            metadata(reader, f"{arch}.rope.dimension_count", hidden // heads)))
    theta = float(metadata(reader, f"{arch}.rope.freq_base", 10000.0))
    params: dict[str, Any] = {
        "architectures": [class_name],
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "num_hidden_layers": int(metadata(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": int(metadata(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "tie_word_embeddings": "output.weight" not in tensors,
        **_special_ids(reader),
    }
    ffn = metadata(reader, f"{arch}.feed_forward_length", None)
    if ffn is not None:
        params["intermediate_size"] = _uniform(ffn, "feed_forward_length")
    if arch in ("llama", "qwen3"):
        params["attention_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "qwen3moe":
        params.update(_moe_params(reader, arch))
    scaling = _rope_scaling(reader, arch, theta, head_dim)
    if arch == "gemma3":
        params.update(_gemma3_params(reader, arch, params, scaling))
    elif arch in _QWEN35_ARCHS:
        params.update(_qwen35_params(reader, arch, params))
        if arch == "qwen35moe":
            params.update(_qwen35_moe_params(reader, arch))
        if scaling is not None:
            params["rope_scaling"] = scaling
    elif scaling is not None:
        params["rope_scaling"] = scaling
    return ModelConfig(model_type, **params)


def _gemma3_params(reader: GGUFFile, arch: str, params: dict[str, Any],
                   scaling: dict[str, Any] | None) -> dict[str, Any]:
    """Gemma 3's layer types, per-type rotary, attention scale and soft-capping, as llama.cpp reads them."""
    count = params["num_hidden_layers"]
    window = metadata(reader, f"{arch}.attention.sliding_window", None)
    pattern = metadata(reader, f"{arch}.attention.sliding_window_pattern", _GEMMA3_SLIDING_PATTERN)
    if isinstance(pattern, list):          # one flag a layer, true where the layer slides
        if len(pattern) != count:
            raise CheckpointError(f"GGUF sliding_window_pattern names {len(pattern)} layers, the model has {count}")
        sliding = [bool(flag) for flag in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(count)]
    if not window:
        sliding = [False] * count
    layer_types = ["sliding_attention" if flag else "full_attention" for flag in sliding]
    local_theta = float(metadata(reader, f"{arch}.rope.freq_base_swa", _GEMMA3_LOCAL_THETA))
    full_rope = {"rope_type": "default", **(scaling or {}), "rope_theta": params["rope_theta"]}
    if count == _GEMMA3_27B_LAYERS:
        scalar = params["hidden_size"] // params["num_attention_heads"]
    else:
        scalar = params["head_dim"]
    extra: dict[str, Any] = {
        "layer_types": layer_types, "sliding_window": int(window) if window else None,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
                            "full_attention": full_rope},
        "query_pre_attn_scalar": scalar, "hidden_activation": "gelu_pytorch_tanh",
        "final_logit_softcapping": metadata(reader, f"{arch}.final_logit_softcapping", None),
        "attn_logit_softcapping": metadata(reader, f"{arch}.attn_logit_softcapping", None),
    }
    return extra


def _qwen35_params(reader: GGUFFile, arch: str, params: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's layer types, Gated DeltaNet shape and partial rotary, as llama.cpp stores them."""
    count = params["num_hidden_layers"]
    interval = int(metadata(reader, f"{arch}.full_attention_interval", 4))
    value_heads = int(metadata(reader, f"{arch}.ssm.time_step_rank"))
    inner = int(metadata(reader, f"{arch}.ssm.inner_size"))
    if inner % value_heads:
        raise CheckpointError(f"GGUF ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {value_heads}")
    rotated = int(metadata(reader, f"{arch}.rope.dimension_count", params["head_dim"]))
    return {
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(count)],
        "linear_num_key_heads": int(metadata(reader, f"{arch}.ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": int(metadata(reader, f"{arch}.ssm.state_size")),
        "linear_value_head_dim": inner // value_heads,
        "linear_conv_kernel_dim": int(metadata(reader, f"{arch}.ssm.conv_kernel")),
        "partial_rotary_factor": rotated / params["head_dim"],
        "hidden_act": "silu",
    }


def _qwen35_moe_params(reader: GGUFFile, arch: str) -> dict[str, Any]:
    """Qwen3.5-MoE's routed and shared experts (every layer sparse; the top-k weights renormalised)."""
    if not metadata(reader, f"{arch}.expert_weights_norm", True):
        raise CheckpointError("GGUF expert_weights_norm=false is not supported for Qwen3.5-MoE (its router always "
                              "renormalises the chosen experts' weights)")
    return {
        "num_experts": int(metadata(reader, f"{arch}.expert_count")),
        "num_experts_per_tok": int(metadata(reader, f"{arch}.expert_used_count")),
        "moe_intermediate_size": int(metadata(reader, f"{arch}.expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(metadata(reader, f"{arch}.expert_shared_feed_forward_length")),
    }


def tiled_to_grouped(array: np.ndarray, num_k_heads: int, num_v_heads: int, axis: int = 0) -> np.ndarray:
    """Undo llama.cpp's Qwen3.5 value-head reorder along ``axis`` (value heads of equal size, in tiled order
    ``k0v0, k1v0, ..., k0v1, ...``) back to grouped by key head (``k0v0, k0v1, ..., k1v0, ...``)."""
    per_k = num_v_heads // num_k_heads
    if per_k <= 1:
        return array
    moved = np.moveaxis(array, axis, 0)
    head = moved.shape[0] // num_v_heads
    grouped = moved.reshape(per_k, num_k_heads, head, *moved.shape[1:]).swapaxes(0, 1)
    return np.moveaxis(np.ascontiguousarray(grouped).reshape(moved.shape), 0, axis)


class GGUFWeights:
    """HF-named float32 tensors of a GGUF file, dequantised one at a time."""

    def __init__(self, reader: GGUFFile, hf_config: ModelConfig) -> None:
        self.reader = reader
        self.arch = architecture(reader)
        self.num_heads = int(hf_config.num_attention_heads)
        self.num_kv_heads = int(hf_config.num_key_value_heads)
        self.linear_heads = ((int(hf_config.linear_num_key_heads), int(hf_config.linear_num_value_heads),
                              2 * int(hf_config.linear_num_key_heads) * int(hf_config.linear_key_head_dim))
                             if self.arch in _QWEN35_ARCHS else None)
        self.check()

    def _tensors(self) -> list[GGUFTensor]:
        return [tensor for tensor in self.reader.tensors if tensor.name != _ROPE_FREQS]

    def check(self) -> None:
        """Fail early on tensors we cannot name or dequantise."""
        for tensor in self._tensors():
            hf_name(tensor.name, self.arch)
            check_type(tensor)

    def count(self) -> int:
        """Number of HF tensors this file yields (stacked experts count once per expert)."""
        total = 0
        for tensor in self._tensors():
            _, part = hf_name(tensor.name, self.arch)
            per_expert = 2 if part == _FUSED_EXPERTS else 1
            total += tensor.shape[0] * per_expert if part in _EXPERT_NAMES else 1
        return total

    def _fix_layout(self, array: np.ndarray, name: str, part: str | None) -> np.ndarray:
        if self.arch in _SHIFTED_NORMS and name.endswith("norm.weight") and part not in _UNSHIFTED_NORM_PARTS:
            return array - np.float32(1.0)
        if part == "ffn_gate_inp_shexp":
            return array.reshape(1, -1)
        if self.linear_heads is not None:
            return self._qwen35_linear(array, part)
        if self.arch == "llama" and part == "attn_q":
            return unpermute_rope_rows(array, self.num_heads)
        if self.arch == "llama" and part == "attn_k":
            return unpermute_rope_rows(array, self.num_kv_heads)
        return array

    def _qwen35_linear(self, array: np.ndarray, part: str | None) -> np.ndarray:
        """A Qwen3.5 DeltaNet tensor back in the checkpoint's layout (other tensors unchanged)."""
        k_heads, v_heads, qk_rows = self.linear_heads
        if part == "ssm_a":
            array = np.log(-array.astype(np.float64)).astype(np.float32)
        if part in ("attn_gate", "ssm_alpha", "ssm_beta", "ssm_a", "ssm_dt"):
            return tiled_to_grouped(array, k_heads, v_heads)
        if part in ("attn_qkv", "ssm_conv1d"):
            array = np.concatenate([array[:qk_rows], tiled_to_grouped(array[qk_rows:], k_heads, v_heads)])
            return array[:, None, :] if part == "ssm_conv1d" else array
        if part == "ssm_out":
            return tiled_to_grouped(array, k_heads, v_heads, axis=1)
        return array

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for tensor in self._tensors():
            name, part = hf_name(tensor.name, self.arch)
            array = self._fix_layout(dequantize(tensor), name, part)
            if part == _FUSED_EXPERTS:
                gate, up = np.split(array, 2, axis=1)
                for expert in range(array.shape[0]):
                    yield name.format(expert).replace("gate_up_proj", "gate_proj"), torch.from_numpy(gate[expert])
                    yield name.format(expert).replace("gate_up_proj", "up_proj"), torch.from_numpy(up[expert])
            elif part in _EXPERT_NAMES:
                for expert in range(array.shape[0]):
                    yield name.format(expert), torch.from_numpy(array[expert])
            else:
                yield name, torch.from_numpy(array)
