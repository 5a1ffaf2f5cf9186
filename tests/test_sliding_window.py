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


# --- KV blocks behind the window ------------------------------------------------------------------------

def _peak_blocks(llm) -> tuple[list[int], object]:
    """Record the blocks in use after every schedule of ``llm``'s engine: (the list it fills, the engine)."""
    core = llm._client.backend.core
    peaks: list[int] = []
    schedule = core.scheduler.schedule

    def recording_schedule():
        chunks = schedule()
        peaks.append(core.blocks.num_blocks - core.blocks.num_free_blocks)
        return chunks

    core.scheduler.schedule = recording_schedule
    return peaks, core


def _long_prompts(count: int, length: int) -> list[list[int]]:
    return [[(500 + 7919 * (i + 1) * (n + 5)) % 49152 for i in range(length)] for n in range(count)]


def test_a_long_generation_releases_the_blocks_behind_the_window(tiny_checkpoint, hf_reference) -> None:
    """A 24-token prompt and 200 new tokens on the tiny Mistral (window 16, blocks of 4): the same greedy tokens
    as transformers, with at most the window's blocks and one step's in use (without release: 56)."""
    prompt = _long_prompts(1, 24)
    expected = hf_reference.greedy(tiny_checkpoint("mistral"), prompt, 200)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint("mistral"), num_kv_blocks=64, block_size=4)) as llm:
        peaks, core = _peak_blocks(llm)
        assert core.blocks.window == 16
        out = llm.generate(prompt, params)
        assert core.blocks.num_free_blocks == core.blocks.num_blocks   # every block back when it ended
    assert out[0].token_ids == expected[0]
    # The prompt's 6 blocks at first; then the window (16 tokens: 4 blocks, 5 when not aligned) and the block
    # being written.
    assert max(peaks) <= 7 and max(peaks[-100:]) <= 6, peaks


@pytest.mark.parametrize("caching", [True, False])
def test_concurrent_requests_fit_a_pool_too_small_without_release(tiny_checkpoint, hf_reference, caching) -> None:
    """Four requests of 80 tokens (20 blocks each) in a 24-block pool: no preemption, the tokens of transformers;
    the same pool without release (a model with a global layer keeps every block) would have to preempt."""
    prompts = _long_prompts(4, 20)
    expected = hf_reference.greedy(tiny_checkpoint("mistral"), prompts, 60)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    args = dict(num_kv_blocks=24, block_size=4, enable_prefix_caching=caching)
    with LLM(EngineArgs(model=tiny_checkpoint("mistral"), **args)) as llm:
        peaks, core = _peak_blocks(llm)
        outputs = llm.generate(prompts, params)
        preemptions = core.scheduler.num_preemptions
    assert [o.token_ids for o in outputs] == expected
    assert preemptions == 0 and max(peaks) < 4 * 20
    with LLM(EngineArgs(model=tiny_checkpoint("mistral"), **args)) as llm:
        core = llm._client.backend.core
        core.blocks.window = None   # as for a model with a global layer
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("reused", [False, True])
def test_a_longer_request_after_release_gets_only_blocks_that_hold_its_tokens(tiny_checkpoint, hf_reference,
                                                                              reused) -> None:
    """With prefix caching, a request that extends a finished one's whole sequence, whose early blocks were
    released during its run, equals transformers. Left alone, the released blocks still hold their tokens and
    the whole chain is found (the first request's 15 computed blocks: 60 tokens); once another request in
    the 20-block pool has reused them, nothing is found and the prompt is computed again."""
    path = tiny_checkpoint("mistral")
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first_prompt, other = _long_prompts(2, 24)
    with LLM(EngineArgs(model=path, num_kv_blocks=20, block_size=4)) as llm:
        core = llm._client.backend.core
        first = llm.generate([first_prompt], params)[0].token_ids
        if reused:
            llm.generate([other], params)   # takes the 4 never used blocks, then the first request's oldest
        longer = first_prompt + first + [7, 8, 9]
        second = llm.generate([longer], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
        cached_keys = list(core.blocks.cached.items())
    assert first == hf_reference.greedy(path, [first_prompt], 40)[0]
    assert second.token_ids == hf_reference.greedy(path, [longer], 12)[0]
    assert second.usage.cached_tokens == (0 if reused else 60)
    # Every registered block is registered under its own key, once.
    assert all(core.blocks.blocks[block].key == key for key, block in cached_keys)


def test_only_a_model_whose_every_layer_slides_declares_a_kv_window() -> None:
    """Mistral declares its window; a model with any full-attention layer (Qwen2 with a global first layer,
    Gemma 3's global layers, Llama) declares none, so its blocks are all kept."""
    from pocketllm.models.gemma3 import Gemma3ForCausalLM

    assert MistralForCausalLM(tiny_config("mistral")).kv_window == 16
    assert Qwen2ForCausalLM(tiny_config("qwen2_swa")).kv_window is None
    assert Gemma3ForCausalLM(tiny_config("gemma3")).kv_window is None
    assert LlamaForCausalLM(tiny_config("mistral")).kv_window is None


def test_release_keeps_the_prefix_cache_and_the_counts_consistent() -> None:
    """Unit: released entries read 0 and are never registered; a released block stays findable until it is
    reused, and a reused one breaks the chain; freeing the request returns every block once."""
    from pocketllm.engine.block_manager import BlockManager
    from pocketllm.engine.request import Request

    manager = BlockManager(12, 4, True, window=6)
    request = Request("a", list(range(100, 124)), SamplingParams(max_tokens=1), frozenset())
    manager.allocate(request, 24)
    table = list(request.block_table)
    request.num_computed_tokens = 24
    manager.cache_full_blocks(request)
    assert manager.release_outside_window(request, 24) == 4   # keys 0..18 are older than 24 - 6 + 1 = 19
    assert request.block_table[:4] == [0] * 4 and request.block_table[4:] == table[4:]
    assert manager.num_free_blocks == 12 - 6 + 4
    assert manager.release_outside_window(request, 24) == 0   # already released
    # The released blocks keep their tokens: a request with the same prompt finds the whole chain.
    again = Request("b", list(range(100, 124)) + [1], SamplingParams(max_tokens=1), frozenset())
    assert manager.cached_prefix(again) == table
    # Another request takes the oldest free blocks, among them released block ``table[0]``: the chain breaks.
    taker = Request("c", [1] * 24, SamplingParams(max_tokens=1), frozenset())
    manager.allocate(taker, 4 * manager.num_free_blocks)
    assert table[0] in taker.block_table and manager.cached_prefix(again) == []
    manager.free_request(taker)
    manager.free_request(request)
    assert manager.num_free_blocks == 12 and all(block.ref_count == 0 for block in manager.blocks)
    assert request.num_released_blocks == 0
    # Without a window (a model with a global layer) nothing is released.
    keeper = BlockManager(12, 4, True)
    kept = Request("d", list(range(24)), SamplingParams(max_tokens=1), frozenset())
    keeper.allocate(kept, 24)
    kept.num_computed_tokens = 24
    assert keeper.release_outside_window(kept, 24) == 0 and 0 not in kept.block_table[1:]
