"""Dummy presets at published shapes: DeepSeek-V4-Flash (and its one-GPU variant) and Gemma 3 1B / 27B build with
the parameter counts their publishers give, and a small one runs ``bench latency`` on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from pocketllm.cli.main import main
from pocketllm.loaders.dummy import PRESETS, preset_config
from pocketllm.models.registry import model_class

H200_BYTES = 141e9


def _parameters(name: str) -> int:
    """Parameters of the preset's model as we build it (on the meta device: shapes only)."""
    config = preset_config(name)
    with torch.device("meta"):
        model = model_class(config)(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, published, tolerance", [
    ("gemma3-1b", 999_885_952, 0.0),          # the model card's exact count
    ("gemma3-27b", 27.0e9, 0.005),            # the text part of the 27B (27.4B with the vision tower)
    ("deepseek-v4-flash", 284e9, 0.005),      # "284B total" (the multi-token-prediction layer not counted)
])
def test_preset_parameter_counts_match_the_published_sizes(name, published, tolerance):
    assert _parameters(name) == pytest.approx(published, rel=tolerance)


def test_deepseek_v4_presets_activate_13b_and_the_small_one_fits_one_h200():
    """Both have DeepSeek-V4-Flash's 13B active parameters a token (6 of the routed experts, the shared one and
    everything else); the 32-expert one holds its bfloat16 weights in about 60% of an H200."""
    config = preset_config("deepseek-v4-flash")
    expert = 3 * config.hidden_size * config.moe_intermediate_size
    for name in ("deepseek-v4-flash", "deepseek-v4-flash-32e"):
        routed = preset_config(name).n_routed_experts
        active = _parameters(name) - (routed - config.num_experts_per_tok) * expert * config.num_hidden_layers
        assert 13e9 <= active < 14e9, name
    assert 2 * _parameters("deepseek-v4-flash") > 4 * H200_BYTES
    assert 2 * _parameters("deepseek-v4-flash-32e") < 0.6 * H200_BYTES


def test_deepseek_v4_flash_preset_is_transformers_default_config():
    """transformers' DeepSeek-V4 defaults are the published DeepSeek-V4-Flash config: the preset types them
    out (layer schedules, compression rates, rotary of both kinds) and equals them."""
    from transformers import DeepseekV4Config

    preset, default = preset_config("deepseek-v4-flash"), DeepseekV4Config()
    for field in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok", "n_routed_experts",
                  "routed_scaling_factor", "layer_types", "compress_rates", "mlp_layer_types", "hc_mult",
                  "hc_sinkhorn_iters", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
                  "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings"):
        assert getattr(preset, field) == getattr(default, field), field
    assert preset.rope_parameters["main"] == default.rope_parameters["main"]
    assert preset.rope_parameters["compress"]["rope_theta"] == 160000.0
    assert preset.rope_parameters["compress"]["rope_type"] == "yarn"
    assert PRESETS["deepseek-v4-flash-32e"]["n_routed_experts"] == 32


def test_bench_latency_runs_the_gemma3_1b_preset_on_the_cpu(tmp_path):
    """``bench latency --model gemma3-1b --load-format dummy`` builds the 1B model with random bfloat16 weights
    on the CPU and times two tokens."""
    out = tmp_path / "latency.json"
    assert main(["bench", "latency", "--model", "gemma3-1b", "--load-format", "dummy", "--device", "cpu",
                 "--dtype", "bfloat16", "--input-len", "4", "--output-len", "2", "--num-iters", "1",
                 "--warmup-iters", "0", "--num-kv-blocks", "16", "--peak-bandwidth-gbs", "10",
                 "--output-json", str(out)]) == 0
    ours = json.loads(out.read_text(encoding="utf-8"))["pocketllm"]
    assert ours["runs"][0]["tokens"] == 2
    assert ours["weight_bytes"] == pytest.approx(2 * 999_885_952, rel=0.01)
