"""DeepSeek-V4 as a served model: the tiny random checkpoint of ``tests/conftest.py`` (sliding, compressed sparse
and heavily compressed layers, hash-routed and score-routed experts, hyper-connections) against transformers'
reference (fp32, CPU) — logits, greedy tokens under the scheduling regimes, and chats through our encoder.

Tolerances: our model computes the same float32 arithmetic in another order (einsum over gathered paged rows
rather than batched matmuls; a chunk at a time where transformers runs the prompt whole), which moves logits by
about 1e-5 (measured ≤ 2e-5 on logits up to ~9); 1e-4 bounds that with margin, while a real error (a wrong
mask, a lost state) moves them by 1e-2 or more.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import assert_logprobs_match, copy_checkpoint, shared_prefix_runs, tiny_config, write_checkpoint
from safetensors.torch import load_file

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import UnsupportedFeatureError

ARCH = "deepseek_v4"
NEW_TOKENS = 32
TOP = 10
# The model runs on the reference step (no CPU decode plan); the default CPU cache would cost more
# than the test itself.
CPU = {"device": "cpu"}
KV = {**CPU, "num_kv_blocks": 256}
REGIMES = {
    "default": KV,
    "prefill-budget-16": {**KV, "max_num_batched_tokens": 16},
    "prefill-budget-5": {**KV, "max_num_batched_tokens": 5},
    "no-chunking": {**KV, "enable_chunked_prefill": False},
    "no-prefix-cache": {**KV, "enable_prefix_caching": False},
    "preemption": {**CPU, "num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 24},
    "async-preemption": {**CPU, "num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 24,
                         "async_scheduling": "on"},
}


def _prompts(vocab: int = 49152) -> list[list[int]]:
    """Mixed lengths: within the 8-token window and the compression rates (4, 8), and well past them."""
    return [[(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)]
            for n, length in enumerate((5, 17, 33, 9, 41))]


def _shared_prefix_prompts() -> list[list[int]]:
    """Two prompts sharing a 50-token prefix (past the window and several compressed entries of each rate)."""
    base = _prompts()[2] + _prompts()[1]
    return [base + [11, 12, 13], base + [21, 22]]


@pytest.fixture(scope="module")
def references(tiny_checkpoint, hf_reference):
    """transformers' greedy continuations of the prompts (``which``: the batch, or the shared-prefix pair),
    computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(which: str = "batch") -> list[list[int]]:
        if which not in cache:
            prompts = _prompts() if which == "batch" else _shared_prefix_prompts()
            cache[which] = hf_reference.greedy(tiny_checkpoint(ARCH), prompts, NEW_TOKENS)
        return cache[which]

    return get


def _model_and_reference(tiny_checkpoint, hf_reference):
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM
    from pocketllm.models.weights import load_weights

    directory = tiny_checkpoint(ARCH)
    checkpoint = load_checkpoint(directory)
    model = DeepseekV4ForCausalLM(checkpoint.hf_config)
    load_weights(model, iter(checkpoint.weight_source))
    return model, directory


def _run_in_chunks(model, ids: list[int], chunk: int, block_size: int = 16, slot: int = 1) -> torch.Tensor:
    """Logits of every position of one sequence fed ``chunk`` tokens a step through the paged cache and the
    state slots (caches and slots bound here, the sequence's blocks in reverse order)."""
    from pocketllm.step.attention_metadata import AttentionMetadata

    blocks = -(-len(ids) // block_size)
    for module in model.modules():
        if type(module).__name__ == "Attention":
            shape = (blocks + 1, block_size, module.num_kv_heads, module.head_dim)
            module.k_cache, module.v_cache = torch.zeros(shape), torch.zeros(shape)
        if hasattr(module, "state_specs"):
            for name, (shape, dtype) in module.state_specs(torch.float32).items():
                setattr(module, name, torch.randn((3, *shape)).to(dtype))   # stale state must not leak in
    table = torch.arange(blocks, 0, -1)[None, :]
    logits = []
    for start in range(0, len(ids), chunk):
        end = min(len(ids), start + chunk)
        positions = torch.arange(start, end)
        meta = AttentionMetadata(slot_mapping=table[0][positions // block_size] * block_size + positions % block_size,
                                 block_tables=table, query_start=[0, end - start], context_lens=[end],
                                 block_size=block_size, state_slots=torch.tensor([slot]), state_slots_host=[slot])
        with torch.no_grad():
            logits.append(model.compute_logits(model(torch.tensor(ids[start:end]), positions, meta)))
    return torch.cat(logits)


def test_layers_follow_the_config(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = tiny_config(ARCH)
    model = DeepseekV4ForCausalLM(config)
    assert model.sliding_windows == [8] * 4
    attention = [layer.self_attn for layer in model.layers]
    assert attention[0].compressor is None and attention[0].rotary is model.rotary["main"]
    assert attention[1].compressor.rate == 4 and attention[1].compressor.indexer.topk == 3
    assert attention[2].compressor.rate == 8 and attention[2].compressor.indexer is None
    assert attention[2].rotary is model.rotary["compress"]
    assert [layer.mlp.gate.hashed for layer in model.layers] == [True, False, False, False]
    assert model.decode_plan() is None
    # The rotary frequencies (plain on sliding layers, YaRN on compressed ones) are transformers'.
    reference = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(ARCH), dtype=torch.float32).model.rotary_emb
    for label in ("main", "compress"):
        torch.testing.assert_close(model.rotary[label].inv_freq, getattr(reference, f"{label}_inv_freq"))
        assert model.rotary[label].scale == getattr(reference, f"{label}_attention_scaling")
    assert not torch.equal(model.rotary["compress"].inv_freq,
                           1.0 / 160000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))


@pytest.mark.parametrize("field, value", [
    ("scoring_func", "softmax"), ("num_key_value_heads", 2), ("hidden_act", "gelu"), ("n_shared_experts", 2),
    ("norm_topk_prob", False), ("quantization_config", {"quant_method": "fp8"}), ("attention_bias", True),
    ("mlp_bias", True), ("tie_word_embeddings", True),
])
def test_features_we_do_not_compute_are_refused_by_name(field, value):
    from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = tiny_config(ARCH)
    setattr(config, field, value)
    with pytest.raises(UnsupportedFeatureError, match=field):
        DeepseekV4ForCausalLM(config)


def test_a_checkpoint_asking_for_softmax_scoring_is_refused_at_load(tiny_checkpoint, tmp_path):
    """Through the public API: a checkpoint whose config.json asks for softmax expert scoring (we compute
    sqrt-softplus only) is refused by the feature's name."""
    directory = copy_checkpoint(tiny_checkpoint(ARCH), str(tmp_path / "softmax"), scoring_func="softmax")
    with pytest.raises(UnsupportedFeatureError, match="scoring_func"):
        LLM(EngineArgs(model=directory, **CPU, num_kv_blocks=16))


def test_rope_types_other_than_default_and_yarn_are_refused():
    from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = tiny_config(ARCH)
    config.rope_parameters["compress"]["rope_type"] = "longrope"
    with pytest.raises(UnsupportedFeatureError, match="rope_type 'longrope'"):
        DeepseekV4ForCausalLM(config)


def test_unknown_architecture_names_still_refused():
    from pocketllm.models.registry import model_class

    config = tiny_config(ARCH)
    config.architectures = ["DeepseekV4ForCausalLM"]
    assert model_class(config).__name__ == "DeepseekV4ForCausalLM"
    config.architectures = ["DeepseekV5ForCausalLM"]
    with pytest.raises(UnsupportedFeatureError, match="DeepseekV5ForCausalLM"):
        model_class(config)


def test_full_prompt_logits_match_transformers(tiny_checkpoint, hf_reference):
    """The whole prompt in one step: every position's logits equal transformers'."""
    model, directory = _model_and_reference(tiny_checkpoint, hf_reference)
    ids = _prompts()[4]
    expected = hf_reference.logits(directory, ids, all_positions=True)
    got = _run_in_chunks(model, ids, len(ids))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_chunked_logits_match_transformers(chunk, tiny_checkpoint, hf_reference):
    """Chunks that split windows at every offset carry the open window and the overlap through the state slot
    (which starts out holding another request's values)."""
    model, directory = _model_and_reference(tiny_checkpoint, hf_reference)
    ids = _prompts()[4]
    expected = hf_reference.logits(directory, ids, all_positions=True)
    got = _run_in_chunks(model, ids, chunk)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(regime, tiny_checkpoint, references):
    """Batched requests of mixed lengths, 32 tokens each, equal transformers' one-at-a-time greedy tokens."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint(ARCH), **REGIMES[regime])) as llm:
        outputs = llm.generate(_prompts(), params)
        core = llm._client.backend.core
        preemptions = core.scheduler.num_preemptions
        free_slots = core.state_pool.num_free_slots
        assert llm.engine_caps().prefix_caching is False
    assert [o.token_ids for o in outputs] == references()
    assert all(o.finish_reason == "length" for o in outputs)
    assert free_slots == core.args.max_num_seqs, "every state slot returns to the pool"
    if regime.endswith("preemption"):
        assert preemptions > 0, "the KV pool was meant to be small enough to force preemption"


def use_graph_steps(llm: LLM):
    """Run the engine's steps through the step CUDA graphs take on a GPU (``ReferenceGraphStep``), eagerly: the
    shapes they record, replayed on CPU. Returns that step."""
    from pocketllm.runner.reference_graphs import ReferenceGraphStep

    core = llm._client.backend.core
    step = ReferenceGraphStep(core.runner.reference_step, replay=False)
    step.setup(core.args.max_num_seqs, core.max_model_len)
    step.scratch_slot = core.runner.num_state_slots   # (as ``allocate_state_pool`` sets it on CUDA)
    core.runner.host_step = step
    core.runner.step_backends = [step]
    return step


@pytest.mark.parametrize("regime", ["default", "prefill-budget-16", "preemption", "async-preemption"])
def test_decode_steps_as_the_cuda_graphs_run_them(regime, tiny_checkpoint, references):
    """The plain decode steps CUDA graphs replay (``runner/reference_graphs.py``), run eagerly here: each batch
    padded to its graph bucket with copies of row 0 (five requests run as eight rows), every compressed history
    padded for a 256-token context (for ``max_model_len``, 120 tokens, in the preemption regimes). The padding
    rows write what row 0 writes, so the tokens still equal transformers'; a padding row with another token (one
    left pending under async scheduling), or a window's overlap state moved on where none closed, would change
    them. With a small prefill budget, prompt chunks run eagerly beside the decode rows' grid."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint(ARCH), **REGIMES[regime])) as llm:
        step = use_graph_steps(llm)
        outputs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outputs] == references()
    assert step.grid_steps >= NEW_TOKENS - 1
    if regime == "prefill-budget-16":
        assert step.split_steps > 0


def test_shared_prefix_with_prefix_caching_asked_for(tiny_checkpoint, references):
    """The compressors' and the window's per-request state is not in the paged cache, so prefix caching is
    declared off for DeepSeek-V4: asking for it changes nothing, and nothing is 'cached'."""
    runs = shared_prefix_runs(tiny_checkpoint(ARCH), _shared_prefix_prompts(), NEW_TOKENS, block_size=4, **KV)
    results = {caching: [o.token_ids for o in first + second + both]
               for caching, (first, second, both) in runs.items()}
    assert all([o.usage.cached_tokens for o in second + both] == [0, 0, 0] for _, second, both in runs.values())
    expected = references("shared")
    assert results[True] == results[False] == expected + expected


def test_logprobs_match_transformers(tiny_checkpoint, hf_reference):
    """Every generated position's top log-probabilities equal transformers' within 1e-4."""
    directory = tiny_checkpoint(ARCH)
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=TOP, ignore_eos=True)
    prompts = [_prompts()[1], _prompts()[4]]
    with LLM(EngineArgs(model=directory, max_num_batched_tokens=16, **KV)) as llm:
        outputs = llm.generate(prompts, params)
    assert_logprobs_match(hf_reference, directory, prompts, outputs, TOP)


def test_chat_is_encoded_by_our_encoder_end_to_end(tiny_checkpoint, hf_reference):
    """The tiny checkpoint ships no chat template: ``LLM.chat`` (with tools) renders it with our DeepSeek-V4
    encoder, the DSML tool parser reads the answer, and the tokens equal transformers' on that prompt."""
    from pocketllm.protocol.deepseek_v4 import encode_messages

    directory = tiny_checkpoint(ARCH)
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory, **KV)) as llm:
        assert llm.tokenizer.chat_template is None
        [out] = llm.chat(messages, params, tools=[tool])
        text = llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)
    assert text == encode_messages(messages, tools=[tool])
    assert "get_weather" in text and text.endswith("<｜Assistant｜></think>")
    assert out.token_ids == hf_reference.greedy(directory, [out.prompt_token_ids], 12)[0]
    assert out.tool_calls is None and out.finish_reason == "length"


def test_mtp_layers_are_skipped_at_load(tiny_checkpoint, references, tmp_path):
    """A checkpoint carrying multi-token-prediction tensors loads (they are skipped) and answers alike."""
    source = tiny_checkpoint(ARCH)
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    weights = load_file(os.path.join(source, "model.safetensors"))
    weights["mtp.0.enorm.weight"] = torch.ones(64)
    weights["model.mtp.0.eh_proj.weight"] = torch.zeros(64, 128)
    directory = str(tmp_path / "with-mtp")
    write_checkpoint(directory, config, weights, source)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory, **KV)) as llm:
        outputs = llm.generate(_prompts()[:2], params)
    assert [o.token_ids for o in outputs] == references()[:2]


def test_transformers_module_names_load_too(tiny_checkpoint, hf_reference, tmp_path):
    """A checkpoint in transformers' module names (``self_attn.*``, experts stacked) loads to the same logits
    as the one in DeepSeek's names that ``save_pretrained`` writes."""
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM
    from pocketllm.models.weights import load_weights

    source = tiny_checkpoint(ARCH)
    assert "model.layers.0.attn.wq_a.weight" in load_file(os.path.join(source, "model.safetensors"))
    weights = {name: tensor.contiguous() for name, tensor in hf_reference.model(source).state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in weights and "model.layers.1.self_attn.sinks" in weights
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    directory = str(tmp_path / "module-names")
    write_checkpoint(directory, config, weights, source)
    checkpoint = load_checkpoint(directory)
    model = DeepseekV4ForCausalLM(checkpoint.hf_config)
    load_weights(model, iter(checkpoint.weight_source))
    ids = _prompts()[2]
    expected = hf_reference.logits(source, ids, all_positions=True)
    torch.testing.assert_close(_run_in_chunks(model, ids, 16), expected, rtol=0, atol=1e-4)


def test_dummy_weights_give_each_token_distinct_hashed_experts(tiny_checkpoint):
    """``load_format="dummy"`` (the benchmark presets): the hash routing table is drawn as a table — each token's
    experts distinct and in range, tokens spread over every expert — not as a weight (which would round to
    expert 0 for all), and the model generates."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint(ARCH), load_format="dummy", **KV)) as llm:
        [out] = llm.generate([_prompts()[1]], params)
        table = llm._client.backend.core.runner.model.layers[0].mlp.gate.tid2eid
    assert len(out.token_ids) == 4
    experts = tiny_config(ARCH).n_routed_experts
    assert table.shape == (49152, 2) and int(table.min()) == 0 and int(table.max()) == experts - 1
    assert bool((table[:, 0] != table[:, 1]).all())
    assert len(torch.unique(table[:, 0])) == experts


def test_bfloat16_strays_from_the_fp32_argmax_only_at_near_ties(tiny_checkpoint, hf_reference):
    """In bfloat16 (what CUDA runs by default; the same reference step here on the CPU) every greedy token is
    transformers' fp32 argmax along that path, or within 5% of the row's largest |logit| of it (measured: 0.9%
    at most here, 3.4% on the GPU tests' prompts). The checkpoint's indexer keeps every entry: with the top 3 of
    the default one, bf16 rounding flips which compressed entries a query keeps, which moves transformers' own
    bf16 logits by up to 36%."""
    directory = tiny_checkpoint("deepseek_v4_keep_all")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory, dtype="bfloat16", **KV)) as llm:
        outputs = llm.generate(_prompts(), params)
    for prompt, out in zip(_prompts(), outputs):
        logits = hf_reference.logits(directory, prompt + out.token_ids, all_positions=True)[len(prompt) - 1:-1]
        gaps = logits.max(-1).values - logits.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert bool((gaps <= 0.05 * logits.abs().max(-1).values + 1e-3).all()), gaps.max()
