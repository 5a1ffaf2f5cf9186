"""Qwen3.5 hybrid models (Gated DeltaNet + gated attention, dense and MoE): kernels, loading, engine parity.

Greedy outputs must equal transformers (fp32, CPU) token for token under every scheduling regime: batched
prompts of different lengths, chunked prefill, forced preemption (recompute restarts the recurrent state),
and shared prefixes with prefix caching asked for (declared off for hybrids, so the answer is unchanged).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import (
    QWEN3_5_KV,
    QWEN3_5_NEW_TOKENS,
    QWEN3_5_REGIMES,
    QWEN3_5_TEMPLATE,
    TINY_HYBRID_ARCHS,
    greedy_in_regime,
    qwen3_5_prompts,
    qwen3_5_shared_prefix_prompts,
    shared_prefix_runs,
    write_checkpoint,
)
from safetensors.torch import load_file

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.layers.gated_delta import (
    causal_conv1d,
    causal_conv1d_step,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
)

pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------- kernels


def _rule_inputs(batch=2, length=150, k_heads=2, v_heads=4, k_dim=16, v_dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, k_heads, k_dim, generator=gen)
    k = torch.randn(batch, length, k_heads, k_dim, generator=gen)
    v = torch.randn(batch, length, v_heads, v_dim, generator=gen)
    g = -2 * torch.rand(batch, length, v_heads, generator=gen)
    beta = torch.rand(batch, length, v_heads, generator=gen)
    state = torch.randn(batch, v_heads, k_dim, v_dim, generator=gen)
    return q, k, v, g, beta, state


def _ours(q, k, v, g, beta):
    """transformers' [B, L, H, D] layout → ours ([B, Hv, L, D], q/k normalised, q scaled, heads repeated)."""
    groups = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2).transpose(1, 2) for x in (q, k))
    return (l2_normalize(q) * q.shape[-1] ** -0.5, l2_normalize(k), v.transpose(1, 2), g.transpose(1, 2),
            beta.transpose(1, 2))


def test_gated_delta_rule_matches_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = _rule_inputs()
    kwargs = dict(initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref_out, ref_state = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    rec_out, rec_state = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, **kwargs)
    torch.testing.assert_close(rec_out, ref_out, atol=1e-5, rtol=1e-5)
    args = _ours(q, k, v, g, beta)
    for name, (out, final) in {
        "chunk64": chunk_gated_delta_rule(*args, state.clone()),
        "chunk16": chunk_gated_delta_rule(*args, state.clone(), chunk_size=16),
        "recurrent": recurrent_gated_delta_rule(*args, state.clone()),
    }.items():
        torch.testing.assert_close(out.transpose(1, 2), ref_out, atol=1e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(final, ref_state, atol=1e-5, rtol=1e-5, msg=name)
    # Split into prefill chunks that carry the state, then single decode steps: the same outputs.
    pieces, carried = [], state.clone()
    for start, end in ((0, 37), (37, 101), (101, 148), (148, 149), (149, 150)):
        part = [x[..., start:end, :] if x.dim() == 4 else x[..., start:end] for x in args]
        rule = recurrent_gated_delta_rule if end - start == 1 else chunk_gated_delta_rule
        out, carried = rule(*part, carried)
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces, dim=2).transpose(1, 2), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(carried, ref_state, atol=1e-5, rtol=1e-5)


def test_causal_conv1d_chunks_and_steps_match_transformers():
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn

    gen = torch.Generator().manual_seed(1)
    length, channels, kernel = 23, 12, 4
    x = torch.randn(length, channels, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    expected = causal_conv1d_fn(x.t().unsqueeze(0), weight)[0].t()
    state = torch.zeros(kernel - 1, channels)
    pieces = []
    for start, end in ((0, 2), (2, 15), (15, 20)):
        out, state = causal_conv1d(x[start:end], weight, state)
        pieces.append(out)
    for t in range(20, length):   # decode steps, batched over one sequence
        out, batched = causal_conv1d_step(x[t:t + 1], weight, state.unsqueeze(0))
        state = batched[0]
        pieces.append(out)
    torch.testing.assert_close(torch.cat(pieces), expected, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------- engine parity

@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
@pytest.mark.parametrize("regime", list(QWEN3_5_REGIMES))
def test_greedy_matches_transformers(arch, regime, tiny_checkpoint, qwen3_5_references):
    outputs = greedy_in_regime(tiny_checkpoint(arch), regime, QWEN3_5_REGIMES[regime], qwen3_5_prompts(),
                               QWEN3_5_NEW_TOKENS)
    assert [o.token_ids for o in outputs] == qwen3_5_references(arch)


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_shared_prefix_with_prefix_caching_asked_for(arch, tiny_checkpoint, qwen3_5_references):
    """Prefix caching is declared off for hybrids: asking for it changes nothing, and nothing is 'cached'."""
    runs = shared_prefix_runs(tiny_checkpoint(arch), qwen3_5_shared_prefix_prompts(), QWEN3_5_NEW_TOKENS,
                              **QWEN3_5_KV)
    results = {caching: [o.token_ids for o in first + second + both]
               for caching, (first, second, both) in runs.items()}
    assert all(second[0].usage.cached_tokens == 0 for _, second, _ in runs.values())
    expected = qwen3_5_references(arch, "shared")
    assert results[True] == results[False] == expected + expected


def test_one_token_prompts_and_cancel_free_slots(tiny_checkpoint, hf_reference):
    """A one-token prompt starts from a zero state in a reused slot; cancelled requests give slots back."""
    directory = tiny_checkpoint("qwen3_5_text")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory, max_num_seqs=2, **QWEN3_5_KV)) as llm:
        llm.generate(qwen3_5_prompts()[:2], params)          # dirty both slots
        outputs = llm.generate([[504], [3575]], params)
        core = llm._client.backend.core
        core.add_request("cancel-me", [1, 2, 3], params)
        core.step()
        assert core.state_pool.num_free_slots == 1
        core.abort("cancel-me")
        assert core.state_pool.num_free_slots == 2
    assert [o.token_ids for o in outputs] == hf_reference.greedy(directory, [[504], [3575]], 8)


# ----------------------------------------------------------------------------------------------- loading


def _as_conditional_generation(text_dir: str, out_dir: str, model_type: str, fuse_experts: bool) -> None:
    """Rewrite a tiny text checkpoint as a ``qwen3_5``-style multimodal one: nested text_config, weights
    under ``model.language_model.``, a vision tensor and an MTP tensor (both to be skipped), experts stacked."""
    with open(os.path.join(text_dir, "config.json"), encoding="utf-8") as handle:
        text_config = json.load(handle)
    architecture = {"qwen3_5": "Qwen3_5ForConditionalGeneration",
                    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}[model_type]
    config = {"architectures": [architecture], "model_type": model_type, "text_config": text_config,
              "vision_config": {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 32,
                                "out_hidden_size": text_config["hidden_size"]},
              "tie_word_embeddings": False}
    weights = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in load_file(os.path.join(text_dir, "model.safetensors")).items():
        parts = name.split(".")
        if fuse_experts and "experts" in parts:           # model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight
            layer_prefix = ".".join(parts[1:parts.index("experts") + 1])
            experts.setdefault(layer_prefix, {}).setdefault(int(parts[-3]), {})[parts[-2]] = tensor
            continue
        weights[name.replace("model.", "model.language_model.", 1)] = tensor
    for prefix, by_expert in experts.items():
        order = sorted(by_expert)
        weights[f"model.language_model.{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]]) for e in order])
        weights[f"model.language_model.{prefix}.down_proj"] = torch.stack([by_expert[e]["down_proj"] for e in order])
    weights["model.visual.patch_embed.proj.weight"] = torch.zeros(16, 3, 2, 16, 16)
    weights["mtp.fc.weight"] = torch.zeros(4, 4)
    write_checkpoint(out_dir, config, weights, text_dir)


@pytest.mark.parametrize("arch, model_type", [("qwen3_5_text", "qwen3_5"), ("qwen3_5_moe_text", "qwen3_5_moe")])
def test_conditional_generation_checkpoint_loads_its_text_part(arch, model_type, tiny_checkpoint,
                                                               qwen3_5_references, tmp_path):
    from pocketllm.loaders.checkpoint import load_checkpoint

    directory = str(tmp_path / model_type)
    _as_conditional_generation(tiny_checkpoint(arch), directory, model_type, fuse_experts=arch.endswith("moe_text"))
    config = load_checkpoint(directory).hf_config
    assert config.model_type == arch and config.vocab_size == 49152
    params = SamplingParams(max_tokens=QWEN3_5_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=directory, **QWEN3_5_KV)) as llm:
        outputs = llm.generate(qwen3_5_prompts()[:2], params)
    assert [o.token_ids for o in outputs] == qwen3_5_references(arch)[:2]


def test_tiny_checkpoints_carry_the_qwen3_5_chat_template(tiny_checkpoint):
    from pocketllm.loaders.checkpoint import load_checkpoint

    with open(QWEN3_5_TEMPLATE, encoding="utf-8") as handle:
        template = handle.read()
    for arch in TINY_HYBRID_ARCHS:
        assert load_checkpoint(tiny_checkpoint(arch)).tokenizer.chat_template == template


@pytest.mark.parametrize("weight_format", ["bfloat16", "int8", "int4"])
def test_moe_block_runs_in_a_cpu_weight_format(weight_format):
    """A CPU weight format replaces the MoE block's input product (router, shared gate and shared [gate; up] in
    one weight) by a module of its own: the block, which splits the product's rows itself, still runs, within the
    format's rounding of the float32 block (where the rows go is checked against transformers elsewhere). In int4
    the input product's rows (4 experts + 1 + 2 * 48) are padded to the kernel's multiple of 16."""
    import copy

    from conftest import tiny_config

    from pocketllm.layers.quantized_linear import FloatOutput, convert_model
    from pocketllm.models.qwen3_5_moe import SharedExpertMoeBlock

    torch.manual_seed(3)
    block = SharedExpertMoeBlock(tiny_config("qwen3_5_moe_text"))
    for param in block.parameters():
        param.data = torch.randn_like(param) * 0.2
    converted = copy.deepcopy(block)
    convert_model(converted, weight_format)
    assert isinstance(converted.input_proj, FloatOutput)   # (int4: the shared down's 48 inputs stay float32)
    x = torch.randn(5, block.input_proj.weight.shape[1])
    expected, out = block(x), converted(x)
    assert float((out - expected).norm() / expected.norm()) < (0.15 if weight_format == "int4" else 0.05)


@pytest.mark.parametrize("preset, cls, moe", [("qwen3.5-9b", "Qwen3_5ForCausalLM", False),
                                              ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM", True)])
def test_dummy_presets(preset, cls, moe):
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.models.registry import model_class

    config = load_checkpoint(preset, "dummy").hf_config
    assert model_class(config).__name__ == cls
    assert config.layer_types.count("full_attention") * 4 == config.num_hidden_layers
    assert config.rope_parameters["partial_rotary_factor"] == 0.25
    assert (getattr(config, "num_experts", 0) == 256) is moe
