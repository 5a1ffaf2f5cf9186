"""Gemma 3 (text): logits and loading against transformers (fp32, CPU); greedy parity over the scheduling
regimes is in test_engine_parity.py."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file, save_file

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


@pytest.mark.parametrize("device_args", [{}, {"device": "cpu"}])
def test_logprobs_match_transformers(device_args, tiny_checkpoint, hf_reference):
    """Every generated position's top log-probabilities (soft-capped logits, both window sides) equal
    transformers' within 1e-4."""
    directory = tiny_checkpoint("gemma3")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, logprobs=TOP, ignore_eos=True)
    with LLM(EngineArgs(model=directory, **device_args)) as llm:
        outputs = llm.generate(_prompts(), params)
    for prompt, out in zip(_prompts(), outputs):
        reference = torch.log_softmax(hf_reference.logits(directory, prompt + out.token_ids, all_positions=True), -1)
        for i, entry in enumerate(out.logprobs):
            row = reference[len(prompt) - 1 + i]
            assert entry.token_id == int(row.argmax())
            assert [alt.token_id for alt in entry.top] == torch.topk(row, TOP).indices.tolist()
            for alt in entry.top:
                assert math.isclose(alt.logprob, row[alt.token_id].item(), abs_tol=1e-4)


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
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    for name in os.listdir(text_dir):
        if name not in ("config.json", "model.safetensors"):
            with open(os.path.join(text_dir, name), "rb") as src, open(os.path.join(out_dir, name), "wb") as dst:
                dst.write(src.read())


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
