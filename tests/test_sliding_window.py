"""Sliding-window attention: which layers slide (read as transformers reads each family's config), the refusals,
and the decode paths that honour the window."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_config

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import CheckpointError, UnsupportedFeatureError
from pocketllm.loaders.model_config import ModelConfig
from pocketllm.models.llama import LlamaForCausalLM
from pocketllm.models.mistral import MistralForCausalLM
from pocketllm.models.qwen2 import Qwen2ForCausalLM
from pocketllm.models.qwen3 import Qwen3ForCausalLM
from pocketllm.models.qwen3_moe import Qwen3MoeForCausalLM
from pocketllm.models.windows import by_layer_type, every_layer, every_layer_if_enabled


def _config(**params) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=4, **params)


def test_mistral_slides_on_every_layer_and_llama_on_none() -> None:
    assert every_layer(_config(sliding_window=16)) == [16] * 4
    assert every_layer(_config(sliding_window=None)) == [None] * 4
    config = tiny_config("mistral")
    assert [layer.self_attn.attn.sliding_window for layer in MistralForCausalLM(config).layers] == [16, 16]
    # transformers' Llama attends over the whole context even where its config carries a sliding_window.
    assert all(layer.self_attn.attn.sliding_window is None for layer in LlamaForCausalLM(config).layers)


def test_qwen2_slides_from_max_window_layers_when_enabled() -> None:
    assert by_layer_type(_config(use_sliding_window=True, sliding_window=8, max_window_layers=2)) == [
        None, None, 8, 8]
    assert by_layer_type(_config(use_sliding_window=False, sliding_window=8, max_window_layers=0)) == [None] * 4
    hf = tiny_config("qwen2_swa")   # transformers filled in layer_types
    assert [layer.self_attn.attn.sliding_window for layer in Qwen2ForCausalLM(hf).layers] == [None, 8]
    gguf_like = ModelConfig("qwen3", **{**_tiny_params(), "use_sliding_window": True, "sliding_window": 8,
                                        "max_window_layers": 1, "num_hidden_layers": 3})
    assert [layer.self_attn.attn.sliding_window for layer in Qwen3ForCausalLM(gguf_like).layers] == [None, 8, 8]


def test_explicit_layer_types_name_the_sliding_layers() -> None:
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    assert by_layer_type(_config(use_sliding_window=True, sliding_window=4, layer_types=types)) == [
        4, None, 4, None]


def test_qwen3_moe_slides_on_every_layer_when_enabled() -> None:
    assert every_layer_if_enabled(_config(use_sliding_window=True, sliding_window=8)) == [8] * 4
    assert every_layer_if_enabled(_config(use_sliding_window=False, sliding_window=8)) == [None] * 4
    params = {**_tiny_params(), "use_sliding_window": True, "sliding_window": 8, "num_experts": 4,
              "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True}
    model = Qwen3MoeForCausalLM(ModelConfig("qwen3_moe", **params))
    assert [layer.self_attn.attn.sliding_window for layer in model.layers] == [8, 8]


@pytest.mark.parametrize(("params", "error", "words"), [
    ({"use_sliding_window": True, "sliding_window": 0}, CheckpointError, "sliding_window"),
    ({"use_sliding_window": True, "sliding_window": 4.5}, CheckpointError, "sliding_window"),
    ({"use_sliding_window": False, "layer_types": ["sliding_attention"] * 4}, CheckpointError, "sliding_window"),
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["full_attention"] * 3}, CheckpointError,
     "layer_types"),
    ({"use_sliding_window": True, "sliding_window": 4, "layer_types": ["chunked_attention"] * 4},
     UnsupportedFeatureError, "chunked_attention"),
])
def test_configs_we_cannot_honour_are_refused_by_name(params, error, words) -> None:
    with pytest.raises(error, match=words):
        by_layer_type(_config(**params))


def _tiny_params() -> dict:
    return {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 128,
            "rms_norm_eps": 1e-6}


def test_reference_backend_masks_keys_older_than_the_window() -> None:
    """Prefill and decode over the paged cache equal dense attention under transformers' sliding mask."""
    from pocketllm.layers.attention import Attention
    from pocketllm.step.attention_metadata import AttentionMetadata

    torch.manual_seed(0)
    heads, kv_heads, dim, block, window, length = 4, 2, 8, 4, 5, 13
    layer = Attention(heads, dim, kv_heads, dim ** -0.5, sliding_window=window)
    layer.k_cache = torch.zeros(8, block, kv_heads, dim)
    layer.v_cache = torch.zeros(8, block, kv_heads, dim)
    q, k, v = torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    table = torch.tensor([[3, 1, 6, 0]])
    slots = torch.tensor([int(table[0, i // block]) * block + i % block for i in range(length)])
    prefill = AttentionMetadata(slots[:-1], table, [0, length - 1], [length - 1], block)
    decode = AttentionMetadata(slots[-1:], table, [0, 1], [length], block)
    out = torch.cat([layer(q[:-1], k[:-1], v[:-1], prefill), layer(q[-1:], k[-1:], v[-1:], decode)])

    pos = torch.arange(length)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    kk, vv = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * dim ** -0.5
    expected = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), vv)
    torch.testing.assert_close(out, expected.reshape(length, heads * dim), rtol=1e-5, atol=1e-5)


def test_cpu_decode_fast_path_takes_the_window(tiny_checkpoint) -> None:
    """The CPU decode step attends each windowed layer over its window: the one-call int4 step takes each
    layer's window; the compiled step takes none, so a windowed model's step stays eager under cpu_compile."""
    with LLM(EngineArgs(model=tiny_checkpoint("mistral"), device="cpu", num_kv_blocks=32, block_size=4,
                        cpu_weight_format="int4")) as llm:
        step = llm._client.backend.core.runner.cpu_decode
        assert step is not None and step.windows == [16]
        assert step.plan.layers[0].attention.sliding_window == 16
        assert step.fused is None or step.fused.windows == [16, 16]
        out = llm.generate([list(range(100, 130))], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with LLM(EngineArgs(model=tiny_checkpoint("mistral"), device="cpu", num_kv_blocks=32, block_size=4,
                        cpu_compile=True)) as llm:
        step = llm._client.backend.core.runner.cpu_decode
        assert step is not None and not step.compiles
