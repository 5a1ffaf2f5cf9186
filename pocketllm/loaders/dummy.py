"""Dummy-weight presets: the published hyper-parameters of real models, typed out (no hub access)."""

from __future__ import annotations

from typing import Any

from pocketllm.errors import CheckpointError

_QWEN3_COMMON: dict[str, Any] = {
    "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645, "dtype": "bfloat16",
}

_LLAMA3_COMMON: dict[str, Any] = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 128000, "dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "max_window_layers": 28, "tie_word_embeddings": True,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36, "tie_word_embeddings": False,
    },
    "qwen3-30b-a3b": {
        **_QWEN3_COMMON, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_window_layers": 48,
        "tie_word_embeddings": False,
    },
    "llama3-8b": {**_LLAMA3_COMMON, "max_position_embeddings": 8192, "eos_token_id": 128001},
    "llama3.1-8b": {
        **_LLAMA3_COMMON, "max_position_embeddings": 131072, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "smollm2-135m": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "dtype": "bfloat16",
    },
}

# Qwen3.5 (hybrid Gated DeltaNet): the text part of the published Qwen3.5-9B and Qwen3.5-35B-A3B configs
# (every fourth layer full attention; mrope sections are degenerate for text positions).
_QWEN3_5_COMMON: dict[str, Any] = {
    "vocab_size": 248320, "head_dim": 256, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": False, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "eos_token_id": 248044, "dtype": "bfloat16",
    "mtp_num_hidden_layers": 1,     # one MTP layer (speculative method "mtp"; random like the rest)
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
}
PRESETS["qwen3.5-9b"] = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"],
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 32, "num_attention_heads": 16,
    "num_key_value_heads": 4,
}
PRESETS["qwen3.5-35b-a3b"] = {
    **_QWEN3_5_COMMON, "model_type": "qwen3_5_moe_text", "architectures": ["Qwen3_5MoeForCausalLM"],
    "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
}

# Gemma 3 27B: the text part of the published gemma-3-27b config (five sliding layers of 1,024 tokens, then one
# full-attention layer; linear rope scaling by 8 on the full layers only).
PRESETS["gemma3-27b"] = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208,
    "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32,
    "num_key_value_heads": 16, "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "dtype": "bfloat16",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
}

# Gemma 3 1B: the published gemma-3-1b config (text only; five sliding layers of 512 tokens, then one full layer;
# no rope scaling).
PRESETS["gemma3-1b"] = {
    "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144,
    "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
    "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "attention_bias": False, "tie_word_embeddings": True, "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
    "dtype": "bfloat16",
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
}

# DeepSeek-V4-Flash: the published config (43 layers: two heavily compressed, then compressed sparse and heavily
# compressed alternating, every layer also sliding over 128 tokens; three hash-routed MoE layers, then
# score-routed; 256 experts, top 6, one shared). 284B parameters with its multi-token-prediction layer (skipped
# here): about 568 GB in bfloat16, more than one GPU holds. ``deepseek-v4-flash-32e`` keeps every shape but 32
# routed experts a layer (the same 13B active per token, about 42B in all: 84 GB in bfloat16, one H200).
_DEEPSEEK_V4_LAYERS = 43
PRESETS["deepseek-v4-flash"] = {
    "model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": _DEEPSEEK_V4_LAYERS,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "num_experts_per_tok": 6, "n_routed_experts": 256, "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "max_position_embeddings": 1048576, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "layer_types": ["heavily_compressed_attention"] * 2 + [
        "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
        for i in range(_DEEPSEEK_V4_LAYERS - 2)],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "mlp_layer_types": ["hash_moe"] * 3 + ["moe"] * (_DEEPSEEK_V4_LAYERS - 3),
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128,
    "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 0,
    "eos_token_id": 1, "dtype": "bfloat16",
}
PRESETS["deepseek-v4-flash-32e"] = {**PRESETS["deepseek-v4-flash"], "n_routed_experts": 32}


def preset_names() -> list[str]:
    """Names accepted with ``load_format="dummy"``."""
    return sorted(PRESETS)


def preset_config(name: str) -> Any:
    """The transformers config of a dummy preset."""
    from transformers import AutoConfig

    if name not in PRESETS:
        raise CheckpointError(f"unknown dummy preset {name!r}; known presets: {', '.join(preset_names())}")
    params = dict(PRESETS[name])
    return AutoConfig.for_model(params.pop("model_type"), **params)
