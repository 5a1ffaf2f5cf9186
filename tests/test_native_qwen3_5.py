"""Qwen3.5 (dense and MoE) on the native plane (pocketllm_cpp): greedy tokens equal transformers (fp32) under
batching of mixed prompt lengths, chunked prefill, 32-token decodes and forced preemption (the recompute restarts
the recurrent state), and log-probabilities equal transformers' within 1e-4; the prefix cache resumes from
recurrent states kept at prompts' block boundaries and at the last one decoding reached; a multimodal checkpoint's
text model (nested text_config, model.language_model.* names, stacked experts, skipped vision and MTP tensors)
loads the same."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TINY_HYBRID_ARCHS
from native_utils import greedy_by_arch, greedy_sampling, mixed_prompts, run_batched, small_engine
from safetensors.torch import load_file, save_file

NEW_TOKENS = 32
PROMPT_LENGTHS = (5, 17, 70, 9)


pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts(vocab: int = 49152) -> list[list[int]]:
    return mixed_prompts(PROMPT_LENGTHS, vocab)


def _batched(native, engine, prompts, new_tokens, slots, budget):
    """Greedy tokens of every prompt, run together through a batch core: {index: tokens}, and the core."""
    tokens, _, core = run_batched(native, engine, prompts, new_tokens, slots, budget)
    return tokens, core


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, hf_reference):
    """transformers' greedy continuations of the mixed-length prompts, once per arch."""
    return greedy_by_arch(hf_reference, tiny_checkpoint, _prompts(), NEW_TOKENS)


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_batched_chunked_greedy_equals_transformers(native, tiny_checkpoint, expected, arch):
    engine = small_engine(native, tiny_checkpoint(arch))
    assert engine.architecture == ("Qwen3_5ForCausalLM" if arch == "qwen3_5_text" else "Qwen3_5MoeForCausalLM")
    # 16-token prefill chunks beside the other rows' decodes: the 70-token prompt spans five steps.
    tokens, _ = _batched(native, engine, _prompts(), NEW_TOKENS, slots=4, budget=16)
    reference = expected(arch)
    assert [tokens[i] for i in range(len(PROMPT_LENGTHS))] == reference
    assert len(set(map(tuple, reference))) == len(PROMPT_LENGTHS)


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_session_generate_and_decode_steps_equal_transformers(native, tiny_checkpoint, expected, hf_reference,
                                                              arch):
    engine = small_engine(native, tiny_checkpoint(arch))
    prompts, reference = _prompts(), expected(arch)
    assert [engine.generate(p, NEW_TOKENS) for p in prompts] == reference
    # A new session restarts the state of the slot the previous one used.
    tokens = [engine.prefill(prompts[2])] + [engine.decode_step() for _ in range(NEW_TOKENS - 1)]
    assert tokens == reference[2]
    one = [prompts[1][0]]   # a one-token prompt: a fresh state and conv window in a single decode-sized chunk
    assert engine.generate(one, 8) == hf_reference.greedy(tiny_checkpoint(arch), [one], 8)[0]


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_prefix_cache_resumes_from_a_kept_state(native, tiny_checkpoint, expected, hf_reference, arch):
    """A repeated prompt, and a later turn that extends it, resume from the recurrent state kept at the prompt's
    last block boundary: the cached tokens are counted and the greedy tokens still equal transformers'."""
    path = tiny_checkpoint(arch)
    engine = small_engine(native, path)
    assert engine.options.prefix_caching and engine.options.state_snapshots > 0
    prompt, reference = _prompts()[2], expected(arch)[2]   # 70 tokens: the state at 64 is kept
    assert engine.generate(prompt, NEW_TOKENS) == reference
    # ... and decoding's last boundary, 96 (101 tokens computed; the one at 80 given up for it)
    assert engine.session_cached_tokens == 0 and engine.num_state_snapshots == 2
    assert engine.generate(prompt, NEW_TOKENS) == reference and engine.session_cached_tokens == 64
    turn = prompt + reference[:12] + _prompts()[0]   # 87 tokens: resumes at 64, keeps the state at 80
    assert engine.generate(turn, 8) == hf_reference.greedy(path, [turn], 8)[0]
    assert engine.session_cached_tokens == 64 and engine.num_state_snapshots == 3
    # Batched, with prefill chunks that pass the kept points: the second wave resumes both prompts.
    prompts = [prompt, turn, _prompts()[1]]
    first, core = _batched(native, engine, prompts, 8, slots=3, budget=16)
    hits = core.stats()["prefix_cache_hits"]   # the engine's count: two sessions above, then two here
    assert hits == 4
    again, core = _batched(native, engine, prompts, 8, slots=3, budget=16)
    assert again == first and core.stats()["prefix_cache_hits"] == hits + 3
    assert [first[i] for i in range(3)] == [reference[:8], hf_reference.greedy(path, [turn], 8)[0],
                                           expected(arch)[1][:8]]
    engine.reset()   # clears the kept states with the cached blocks
    assert engine.num_state_snapshots == 0
    assert engine.generate(prompt, 4) == reference[:4] and engine.session_cached_tokens == 0


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_a_later_turn_resumes_after_the_answer(native, tiny_checkpoint, hf_reference, arch):
    """Decoding keeps the state at each block boundary it reaches, in place of the one before: the next turn
    (prompt, answer, new text) resumes at the answer's last boundary instead of the first prompt's."""
    path = tiny_checkpoint(arch)
    engine = small_engine(native, path)
    prompt = _prompts()[0] + _prompts()[1]   # 22 tokens: its kept state is at 16
    answer = engine.generate(prompt, 30)      # 51 tokens computed: decoding passes 32 and 48
    assert answer == hf_reference.greedy(path, [prompt], 30)[0]
    assert engine.num_state_snapshots == 2    # 16 and 48: the one at 32 was given up for 48
    turn = prompt + answer + [5, 6, 7]
    assert engine.generate(turn, 6) == hf_reference.greedy(path, [turn], 6)[0]
    assert engine.session_cached_tokens == 48


def test_kept_states_are_bounded_and_can_be_turned_off(native, tiny_checkpoint, expected):
    path = tiny_checkpoint("qwen3_5_text")
    engine = small_engine(native, path, state_snapshots=1)
    prompts, reference = _prompts(), expected("qwen3_5_text")
    assert engine.generate(prompts[2], 4) == reference[2][:4]
    assert engine.generate(prompts[1], 4) == reference[1][:4]   # its state at 16 replaces the one at 64
    assert engine.num_state_snapshots == 1
    assert engine.generate(prompts[2], 4) == reference[2][:4] and engine.session_cached_tokens == 0
    assert engine.generate(prompts[1], 4) == reference[1][:4] and engine.session_cached_tokens == 0   # evicted
    off = small_engine(native, path, state_snapshots=0, prefix_caching=True)
    assert not off.options.prefix_caching
    first = off.prefill(prompts[2])
    assert off.prefill(prompts[2]) == first and off.session_cached_tokens == 0 and off.num_state_snapshots == 0
    with pytest.raises(ValueError, match="state_snapshots"):
        small_engine(native, path, state_snapshots=-1)


def test_preemption_recomputes_the_recurrent_state(native, tiny_checkpoint, hf_reference):
    path = tiny_checkpoint("qwen3_5_moe_text")
    engine = small_engine(native, path, block_size=4, num_kv_blocks=12)   # 48 positions for three 20-token sequences
    prompts = [p[:8] for p in _prompts()[1:]]
    tokens, core = _batched(native, engine, prompts, 12, slots=3, budget=3)
    assert core.stats()["num_preemptions"] > 0
    assert [tokens[i] for i in range(3)] == hf_reference.greedy(path, prompts, 12)


def test_multimodal_layout_with_stacked_experts_loads_the_same(native, tiny_checkpoint, expected, tmp_path):
    """The text model of a Qwen3_5MoeForConditionalGeneration checkpoint: config under text_config, weights under
    model.language_model., experts stacked, vision and multi-token-prediction tensors present and skipped."""
    source = tiny_checkpoint("qwen3_5_moe_text")
    with open(os.path.join(source, "config.json"), encoding="utf-8") as handle:
        text_config = json.load(handle)
    text_config.pop("architectures", None)
    config = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
              "text_config": text_config, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    weights = load_file(os.path.join(source, "model.safetensors"))
    experts = text_config["num_experts"]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if ".mlp.experts." in name:
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = tensor
    for layer in range(text_config["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        out[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}{e}.gate_proj.weight"], weights[f"{p}{e}.up_proj.weight"]]) for e in
             range(experts)])
        out[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [weights[f"{p}{e}.down_proj.weight"] for e in range(experts)])
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    out["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(out, str(tmp_path / "model.safetensors"))
    with open(tmp_path / "config.json", "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    engine = small_engine(native, str(tmp_path))
    assert engine.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert engine.generate(_prompts()[1], NEW_TOKENS) == expected("qwen3_5_moe_text")[1]


@pytest.mark.parametrize("arch", TINY_HYBRID_ARCHS)
def test_logprobs_equal_transformers(native, tiny_checkpoint, hf_reference, arch):
    """Every generated position's log-probabilities (chosen token and top 5) equal transformers' within 1e-4, with
    the 70-token prompt's prefill split into 16-token chunks."""
    path = tiny_checkpoint(arch)
    prompt = _prompts()[2]
    core = native.QwenBatchCore(small_engine(native, path), 2)
    core.set_prefill_token_budget(16)
    sampling = greedy_sampling(native, 12)
    sampling.logprobs = 5
    core.add("l", prompt, sampling)
    events = []
    while core.has_work():
        events += core.step()
    tokens = [e.token for e in events]
    reference = torch.log_softmax(hf_reference.logits(path, prompt + tokens, all_positions=True), -1)
    for i, event in enumerate(events):
        row = reference[len(prompt) - 1 + i]
        assert event.token == int(row.argmax())
        assert abs(event.logprob - row[event.token].item()) < 1e-4
        assert list(event.top_ids) == torch.topk(row, 5).indices.tolist()
        assert max(abs(a - row[t].item()) for a, t in zip(event.top_logprobs, event.top_ids)) < 1e-4
