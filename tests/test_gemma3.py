"""Gemma 3 (text): logits and loading (safetensors, the multimodal checkpoint's text part, GGUF) against
transformers (fp32, CPU); greedy parity over the scheduling regimes is in test_engine_parity.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import TINY_CONFIGS, assert_logprobs_match, copy_checkpoint, gguf_writer, tiny_config, write_checkpoint
from safetensors.torch import load_file

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import UnsupportedFeatureError

NEW_TOKENS = 32
TOP = 20


def _prompts(vocab: int = 49152) -> list[list[int]]:
    """Prompts shorter and longer than the tiny model's 8-token window."""
    return [[(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)] for n, length in enumerate((5, 33))]


def test_layers_windows_and_rotary_bases_follow_the_config():
    from pocketllm.models.gemma3 import Gemma3ForCausalLM

    model = Gemma3ForCausalLM(tiny_config("gemma3"))
    assert model.sliding_windows == [8, None, 8, None]
    sliding, full = model.layers[0].self_attn, model.layers[1].self_attn
    assert sliding.attn.sliding_window == 8 and full.attn.sliding_window is None
    assert sliding.rotary_emb.base == 100.0 and sliding.rotary_emb.scaling is None
    assert full.rotary_emb.base == 10000.0 and full.rotary_emb.scaling["rope_type"] == "linear"
    assert model.layers[2].self_attn.rotary_emb is sliding.rotary_emb      # one table per layer type
    assert sliding.attn.scale == pytest.approx(24 ** -0.5)
    assert model.decode_plan() is None


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True),
                                          ("hidden_activation", "relu")])
def test_features_we_do_not_compute_are_refused_by_name(field, value):
    from pocketllm.models.gemma3 import Gemma3ForCausalLM

    config = tiny_config("gemma3")
    setattr(config, field, value)
    with pytest.raises(UnsupportedFeatureError, match=field):
        Gemma3ForCausalLM(config)


def test_a_checkpoint_asking_for_attention_soft_capping_is_refused_at_load(tiny_checkpoint, tmp_path):
    """Through the public API: a Gemma 3 checkpoint whose config.json soft-caps attention logits is refused by
    the feature's name."""
    directory = copy_checkpoint(tiny_checkpoint("gemma3"), str(tmp_path / "softcap"), attn_logit_softcapping=50.0)
    with pytest.raises(UnsupportedFeatureError, match="attn_logit_softcapping"):
        LLM(EngineArgs(model=directory, device="cpu", num_kv_blocks=16))


@pytest.mark.parametrize("device_args", [{}, {"device": "cpu"}])
def test_logprobs_match_transformers(device_args, tiny_checkpoint, hf_reference):
    """Every generated position's top log-probabilities (soft-capped logits, both window sides) equal
    transformers' within 1e-4."""
    directory = tiny_checkpoint("gemma3")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True)
    with LLM(EngineArgs(model=directory, **device_args)) as llm:
        outputs = llm.generate(_prompts(), params)
    assert_logprobs_match(hf_reference, directory, _prompts(), outputs, TOP)


def test_full_prompt_logits_match_transformers(tiny_checkpoint, hf_reference):
    """The model's soft-capped logits at every prompt position equal transformers' (reference attention)."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.gemma3 import Gemma3ForCausalLM
    from pocketllm.models.weights import load_weights

    directory = tiny_checkpoint("gemma3")
    checkpoint = load_checkpoint(directory)
    model = Gemma3ForCausalLM(checkpoint.hf_config)
    load_weights(model, iter(checkpoint.weight_source))
    ids = _prompts()[1]
    expected = hf_reference.logits(directory, ids, all_positions=True)
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)), _causal_meta(model, len(ids))))
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)
    cap = checkpoint.hf_config.final_logit_softcapping
    assert got.abs().max() < cap


def _causal_meta(model, length: int):
    """Reference-backend metadata for one prompt of ``length`` tokens in blocks of 16 (caches bound here)."""
    from pocketllm.step.attention_metadata import AttentionMetadata

    blocks = -(-length // 16)
    for module in model.modules():
        if hasattr(module, "k_cache") and hasattr(module, "backend"):
            module.k_cache = torch.zeros(blocks, 16, module.num_kv_heads, module.head_dim)
            module.v_cache = torch.zeros(blocks, 16, module.num_kv_heads, module.head_dim)
    return AttentionMetadata(slot_mapping=torch.arange(length), block_tables=torch.arange(blocks)[None, :],
                             query_start=[0, length], context_lens=[length], block_size=16)


def _as_conditional_generation(text_dir: str, out_dir: str, prefix: str) -> None:
    """Rewrite the tiny text checkpoint as a ``gemma3`` multimodal one: nested text_config, weights under
    ``prefix``, vision and projector tensors (to be skipped)."""
    with open(os.path.join(text_dir, "config.json"), encoding="utf-8") as handle:
        text_config = json.load(handle)
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text_config, "tie_word_embeddings": True,
              "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                                "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 32,
                                "patch_size": 16}, "mm_tokens_per_image": 4}
    weights = {name.replace("model.", prefix, 1): tensor
               for name, tensor in load_file(os.path.join(text_dir, "model.safetensors")).items()}
    vision = "vision_tower." if prefix.startswith("language_model") else "model.vision_tower."
    weights[vision + "vision_model.embeddings.patch_embedding.weight"] = torch.zeros(16, 3, 16, 16)
    weights[vision.replace("vision_tower", "multi_modal_projector") + "mm_input_projection_weight"] = torch.zeros(4, 4)
    write_checkpoint(out_dir, config, weights, text_dir)


@pytest.mark.parametrize("prefix", ["model.language_model.", "language_model.model."])
def test_conditional_generation_checkpoint_loads_its_text_part(prefix, tiny_checkpoint, hf_reference, tmp_path):
    from pocketllm.loaders.checkpoint import load_checkpoint

    text_dir = tiny_checkpoint("gemma3")
    directory = str(tmp_path / "gemma3")
    _as_conditional_generation(text_dir, directory, prefix)
    config = load_checkpoint(directory).hf_config
    assert config.model_type == "gemma3_text" and config.architectures == ["Gemma3ForCausalLM"]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory)) as llm:
        outputs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outputs] == hf_reference.greedy(text_dir, _prompts(), NEW_TOKENS)


def test_the_checkpoint_directory_chat_template_is_used(tiny_checkpoint):
    from pocketllm.loaders.checkpoint import load_checkpoint

    directory = tiny_checkpoint("gemma3")
    with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as handle:
        saved = json.load(handle).get("chat_template")
    if saved is None:
        with open(os.path.join(directory, "chat_template.jinja"), encoding="utf-8") as handle:
            saved = handle.read()
    assert load_checkpoint(directory).tokenizer.chat_template == saved


def _gguf_name(name: str) -> str:
    """llama.cpp's Gemma 3 tensor name for an HF parameter name."""
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if name in globals_:
        return globals_[name]
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{parts[module]}.{suffix}"


def _write_gemma3_gguf(path: str, config: dict, state: dict[str, torch.Tensor]) -> None:
    """The checkpoint as llama.cpp's converter writes a Gemma 3 GGUF (F32): norms stored as ``1 + w``, no
    output tensor (tied), the window, its pattern, both rotary bases and the soft-capping in the metadata."""
    gguf = pytest.importorskip("gguf")
    writer = gguf_writer(gguf, path, "gemma3", config)
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    writer.add_tokenizer_model("llama")     # a SentencePiece vocabulary, as Gemma's
    writer.add_token_list(["<unk>", "<bos>", "<eos>"] + [f"<tok{i}>" for i in range(3, config["vocab_size"])])
    writer.add_token_scores([0.0] * config["vocab_size"])
    writer.add_token_types([gguf.TokenType.NORMAL] * config["vocab_size"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_unk_token_id(0)
    for name, tensor in state.items():
        if name == "lm_head.weight":
            continue
        array = tensor.float().numpy()
        if name.endswith("norm.weight"):
            array = array + np.float32(1.0)
        writer.add_tensor(_gguf_name(name), array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_equals_the_safetensors_checkpoint(tiny_checkpoint, hf_reference, tmp_path):
    """A Gemma 3 GGUF written as llama.cpp writes one loads to the checkpoint's weights (norms unshifted) and
    config, and answers as transformers answers the checkpoint. llama.cpp's attention scale for a model that is
    not the 27B is head_dim ** -0.5, so the checkpoint here sets query_pre_attn_scalar = head_dim."""
    from pocketllm.loaders.checkpoint import load_checkpoint

    head_dim = TINY_CONFIGS["gemma3"]["head_dim"]
    directory = copy_checkpoint(tiny_checkpoint("gemma3"), str(tmp_path / "gemma3"), query_pre_attn_scalar=head_dim)
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    state = load_file(os.path.join(directory, "model.safetensors"))
    path = str(tmp_path / "gemma3.gguf")
    _write_gemma3_gguf(path, config, state)

    checkpoint = load_checkpoint(path)
    ours, original = checkpoint.hf_config, load_checkpoint(directory).hf_config
    assert ours.architectures == ["Gemma3ForCausalLM"] and ours.tie_word_embeddings
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "final_logit_softcapping", "head_dim",
                "hidden_size", "intermediate_size", "num_key_value_heads"):
        assert getattr(ours, key) == getattr(original, key), key
    for kind in ("sliding_attention", "full_attention"):
        assert ours.rope_parameters[kind] == original.rope_parameters[kind], kind
    weights = dict(checkpoint.iter_weights())
    assert set(weights) == set(state) - {"lm_head.weight"}
    for name, tensor in weights.items():
        torch.testing.assert_close(tensor, state[name].float(), rtol=0, atol=1e-6)

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path)) as llm:
        outputs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outputs] == hf_reference.greedy(directory, _prompts(), NEW_TOKENS)


@pytest.mark.parametrize("weight_format", ["int4", "int8", "bfloat16"])
def test_cpu_weight_formats_run_the_reference_decode(weight_format, tiny_checkpoint):
    """No CPU decode plan describes Gemma 3, so every CPU weight format decodes through the reference path."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint("gemma3"), device="cpu", cpu_weight_format=weight_format)) as llm:
        assert llm._client.backend.core.runner.cpu_decode is None
        outputs = llm.generate(_prompts(), params)
    assert [len(o.token_ids) for o in outputs] == [8, 8]


def test_gemma3_27b_preset_builds_at_its_real_layer_shape():
    """The dummy preset: five sliding layers then a full one, the 27B attention scale, two rotary bases."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.gemma3 import Gemma3ForCausalLM

    config = load_checkpoint("gemma3-27b", "dummy").hf_config
    assert config.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    config.num_hidden_layers, config.layer_types = 6, config.layer_types[:6]
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
    assert model.sliding_windows == [1024] * 5 + [None]
    assert model.layers[0].self_attn.attn.scale == pytest.approx(168 ** -0.5)
    assert model.layers[0].self_attn.rotary_emb.base == 10000.0
    assert model.layers[5].self_attn.rotary_emb.scaling["factor"] == 8.0
