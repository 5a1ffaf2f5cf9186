"""Qwen3.5 and Qwen3.5-MoE from llama.cpp GGUF files (``qwen35``, ``qwen35moe``): the tiny checkpoints written
as llama.cpp's converter writes them, with the ``gguf`` package, load to the same config and weights as the
safetensors checkpoints, and give the same greedy tokens (transformers') and log-probabilities."""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from conftest import gguf_writer
from safetensors.torch import load_file

from pocketllm import LLM, EngineArgs, SamplingParams

NEW_TOKENS = 24
TOP = 5
KV = {"device": "cpu", "num_kv_blocks": 256}
GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
         "linear_attn.in_proj_qkv": "attn_qkv", "linear_attn.in_proj_z": "attn_gate",
         "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.in_proj_b": "ssm_beta",
         "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm", "linear_attn.out_proj": "ssm_out",
         # Qwen3.5-MoE: the router, the shared expert and its gate
         "mlp.gate": "ffn_gate_inp", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
         "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
         "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(vocab: int = 49152) -> list[list[int]]:
    """Lengths within and past one 64-token chunk of the DeltaNet rule."""
    return [[(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)]
            for n, length in enumerate((5, 17, 70))]


def _grouped_to_tiled(tensor: torch.Tensor, k_heads: int, v_heads: int, dim: int = 0) -> torch.Tensor:
    """llama.cpp's converter's value-head order: from grouped by key head to tiled (see gguf_loader.py)."""
    per_k = v_heads // k_heads
    moved = tensor.movedim(dim, 0)
    head = moved.shape[0] // v_heads
    tiled = moved.reshape(k_heads, per_k, head, *moved.shape[1:]).transpose(0, 1).reshape(moved.shape)
    return tiled.movedim(0, dim)


def _gguf_tensors(name: str, tensor: torch.Tensor, config: dict,
                  fuse_gate_up: bool) -> list[tuple[str, torch.Tensor]]:
    """(llama.cpp's tensor name, the tensor as its converter writes it) for a checkpoint entry; the stacked
    experts' gate-up tensor is split in halves unless ``fuse_gate_up`` (the converter's gate-up fusion)."""
    k_heads, v_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk_rows = 2 * k_heads * config["linear_key_head_dim"]
    if name.endswith("norm.weight") and ".linear_attn." not in name:
        tensor = tensor + 1.0
    if name in GLOBALS:
        return [(GLOBALS[name], tensor)]
    _, _, layer, rest = name.split(".", 3)
    if rest == "linear_attn.A_log":
        return [(f"blk.{layer}.ssm_a", _grouped_to_tiled(-tensor.exp(), k_heads, v_heads))]
    if rest == "linear_attn.dt_bias":
        return [(f"blk.{layer}.ssm_dt.bias", _grouped_to_tiled(tensor, k_heads, v_heads))]
    if rest == "mlp.experts.gate_up_proj":        # [experts, 2 * width, hidden]: gate rows, then up rows
        if fuse_gate_up:
            return [(f"blk.{layer}.ffn_gate_up_exps.weight", tensor)]
        gate, up = tensor.chunk(2, dim=1)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    if rest == "mlp.experts.down_proj":
        return [(f"blk.{layer}.ffn_down_exps.weight", tensor)]
    module, suffix = rest.rsplit(".", 1)
    part = PARTS[module]
    if part in ("attn_gate", "ssm_alpha", "ssm_beta"):
        tensor = _grouped_to_tiled(tensor, k_heads, v_heads)
    elif part in ("attn_qkv", "ssm_conv1d"):
        tensor = tensor.reshape(tensor.shape[0], -1)   # the conv kernel squeezed to [channels, K]
        tensor = torch.cat([tensor[:qk_rows], _grouped_to_tiled(tensor[qk_rows:], k_heads, v_heads)])
    elif part == "ssm_out":
        tensor = _grouped_to_tiled(tensor, k_heads, v_heads, dim=1)
    return [(f"blk.{layer}.{part}.{suffix}", tensor)]


def _stacked_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint with per-expert tensors (``mlp.experts.E.gate_proj.weight``, as ``save_pretrained`` writes
    them) stacked per layer, as llama.cpp's converter merges them: ``gate_up_proj`` [E, 2I, H], ``down_proj``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        match = re.match(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", name)
        if match is None:
            out[name] = tensor
            continue
        prefix, index, part = match.groups()
        experts.setdefault(prefix, {}).setdefault(part, {})[int(index)] = tensor
    for prefix, parts in experts.items():
        gate, up, down = (torch.stack([parts[p][i] for i in sorted(parts[p])]) for p in ("gate", "up", "down"))
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = down
    return out


def _write_gguf(path: str, arch: str, config: dict, state: dict[str, torch.Tensor], fuse_gate_up: bool,
                expert_weights_norm: bool | None = None) -> None:
    """The checkpoint as llama.cpp's converter writes a Qwen3.5 (``qwen35``) or Qwen3.5-MoE (``qwen35moe``)
    GGUF, in F32 (``expert_weights_norm``: that key too, when not None)."""
    gguf = pytest.importorskip("gguf")
    writer = gguf_writer(gguf, path, arch, config)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(int(config["head_dim"] * rope["partial_rotary_factor"]))
    writer.add_full_attention_interval(config["layer_types"].index("full_attention") + 1)
    writer.add_ssm_conv_kernel(config["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(config["linear_key_head_dim"])
    writer.add_ssm_group_count(config["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(config["linear_num_value_heads"])
    writer.add_ssm_inner_size(config["linear_num_value_heads"] * config["linear_value_head_dim"])
    if arch == "qwen35moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
        if expert_weights_norm is not None:
            writer.add_expert_weights_norm(expert_weights_norm)
    writer.add_tokenizer_model("llama")   # a placeholder vocabulary: the test runs on token ids
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"<tok{i}>" for i in range(3, config["vocab_size"])])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    for name, tensor in _stacked_experts(state).items():
        for gguf_name, converted in _gguf_tensors(name, tensor.float(), config, fuse_gate_up):
            writer.add_tensor(gguf_name, converted.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _loaded_model(path: str) -> torch.nn.Module:
    """Our model with the checkpoint's weights loaded (GGUF or safetensors), on the CPU."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.registry import model_class
    from pocketllm.models.weights import load_weights

    checkpoint = load_checkpoint(path)
    model = model_class(checkpoint.hf_config)(checkpoint.hf_config)
    load_weights(model, checkpoint.iter_weights())
    return model


def _generate(path: str) -> list:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True)
    with LLM(EngineArgs(model=path, **KV)) as llm:
        return llm.generate(_prompts(), params)


@pytest.mark.parametrize("arch, gguf_arch, fuse_gate_up", [
    ("qwen3_5_text", "qwen35", False),
    ("qwen3_5_moe_text", "qwen35moe", False),
    ("qwen3_5_moe_text", "qwen35moe", True),
], ids=["qwen35", "qwen35moe", "qwen35moe-fused-gate-up"])
def test_gguf_equals_the_safetensors_checkpoint(arch, gguf_arch, fuse_gate_up, tiny_checkpoint, hf_reference,
                                                tmp_path):
    """A GGUF written as llama.cpp's converter writes one (norms as 1 + w, -exp(A_log), the conv kernel
    squeezed, the value heads tiled: 4 value heads over 2 key heads; for the MoE the experts stacked per layer,
    split or fused, the shared expert and its gate) loads to the checkpoint's config and to the same parameters,
    and generates transformers' greedy tokens with the log-probabilities of the safetensors load."""
    from pocketllm.loaders.checkpoint import load_checkpoint

    directory = tiny_checkpoint(arch)
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    state = load_file(os.path.join(directory, "model.safetensors"))
    path = str(tmp_path / f"{arch}.gguf")
    _write_gguf(path, gguf_arch, config, state, fuse_gate_up)

    ours, original = load_checkpoint(path).hf_config, load_checkpoint(directory).hf_config
    assert ours.architectures == original.architectures and not ours.tie_word_embeddings
    keys = ["layer_types", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "head_dim", "num_key_value_heads"]
    if gguf_arch == "qwen35moe":
        keys += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    for key in keys:
        assert getattr(ours, key) == getattr(original, key), key
    assert ours.partial_rotary_factor == original.rope_parameters["partial_rotary_factor"]
    from_gguf, from_safetensors = _loaded_model(path).state_dict(), _loaded_model(directory).state_dict()
    assert set(from_gguf) == set(from_safetensors)
    for name, tensor in from_gguf.items():
        torch.testing.assert_close(tensor, from_safetensors[name], rtol=1e-6, atol=1e-6, msg=name)

    outputs, expected = _generate(path), _generate(directory)
    assert [o.token_ids for o in outputs] == hf_reference.greedy(directory, _prompts(), NEW_TOKENS)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for out, reference in zip(outputs, expected):
        for got, want in zip(out.logprobs, reference.logprobs):
            assert [alt.token_id for alt in got.top] == [alt.token_id for alt in want.top]
            for a, b in zip(got.top, want.top):
                assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)


def test_qwen35moe_gguf_without_renormalised_expert_weights_is_refused(tiny_checkpoint, tmp_path):
    """llama.cpp may store ``expert_weights_norm``; Qwen3.5-MoE always renormalises, so false is refused by name."""
    from pocketllm.errors import CheckpointError
    from pocketllm.loaders.checkpoint import load_checkpoint

    directory = tiny_checkpoint("qwen3_5_moe_text")
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    path = str(tmp_path / "no-norm.gguf")
    state = load_file(os.path.join(directory, "model.safetensors"))
    _write_gguf(path, "qwen35moe", config, state, False, expert_weights_norm=False)
    with pytest.raises(CheckpointError, match="expert_weights_norm"):
        load_checkpoint(path)
