"""Greedy outputs equal HF transformers (fp32, CPU) token for token, under every scheduling regime."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import greedy_in_regime

from pocketllm import LLM, EngineArgs, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "qwen2_swa", "gemma3", "llama_swa", "qwen3_swa",
         "qwen3_moe_swa"]
# Llama with ``sliding_window`` in its config: transformers' forward attends fully, and so do we; its reference is
# generated over a cache of full layers (``hf_greedy``'s ``full_cache``).
FULL_CACHE_REFERENCE = ("llama_swa",)
PROMPT_LENGTHS = (5, 17, 33, 9)
NEW_TOKENS = 32


def _prompts(vocab: int = 49152) -> list[list[int]]:
    """Deterministic prompts of different lengths (the 9-token one shares the 33-token one's start)."""
    prompts = []
    for n, length in enumerate(PROMPT_LENGTHS):
        prompts.append([(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)])
    prompts[3] = prompts[2][:9]
    return prompts


REGIMES = {
    "default": {},
    "prefill-budget-16": {"max_num_batched_tokens": 16},
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-chunking": {"enable_chunked_prefill": False},
    "preemption": {"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 24},
    # Step N+1 scheduled and launched before step N's tokens are read back (the CUDA default).
    "async-scheduling": {"async_scheduling": "on"},
    "async-preemption": {"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 24,
                         "async_scheduling": "on"},
}


# Every layer of the tiny Mistral and of the windowed Qwen3-MoE slides, so their requests release the blocks behind
# the window and a 20-block pool no longer preempts: 17 blocks (68 tokens, the longest request's 65 fit) do.
PREEMPTION_POOL = {"mistral": 17, "qwen3_moe_swa": 17}


def _regime(arch: str, regime: str) -> dict:
    args = dict(REGIMES[regime])
    if regime.endswith("preemption") and arch in PREEMPTION_POOL:
        args["num_kv_blocks"] = PREEMPTION_POOL[arch]
    return args


def _reference_greedy(hf_reference, directory: str, arch: str, prompts: list[list[int]], new_tokens: int):
    return hf_reference.greedy(directory, prompts, new_tokens, full_cache=arch in FULL_CACHE_REFERENCE)


@pytest.fixture(scope="module")
def references(tiny_checkpoint, hf_reference):
    """HF greedy continuations per architecture, computed once."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = _reference_greedy(hf_reference, tiny_checkpoint(arch), arch, _prompts(), NEW_TOKENS)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("regime", list(REGIMES))
def test_greedy_matches_transformers(arch, regime, tiny_checkpoint, references):
    outputs = greedy_in_regime(tiny_checkpoint(arch), regime, _regime(arch, regime), _prompts(), NEW_TOKENS)
    assert [o.token_ids for o in outputs] == references(arch)


@pytest.mark.parametrize("regime", ["default", "async-preemption", "prefill-budget-16"])
def test_longest_first_decode_rows_keep_outputs(regime, tiny_checkpoint, references):
    """The CUDA engine runs a step's decode rows longest context first; that row order, here forced on CPU,
    still gives every request its own tokens (pending tokens, sampling rows and outputs follow the rows)."""
    expected = references("llama")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    decode_rows: list[list[int]] = []   # per step, the context lengths of the one-token rows in row order
    with LLM(EngineArgs(model=tiny_checkpoint("llama"), **REGIMES[regime])) as llm:
        core = llm._client.backend.core
        core.longest_first = True
        launch = core.runner.launch

        def recording_launch(chunks, *args, **kwargs):
            decode_rows.append([c.end for c in chunks if c.num_tokens == 1])
            return launch(chunks, *args, **kwargs)

        core.runner.launch = recording_launch
        outputs = llm.generate(_prompts(), params)
    assert [o.token_ids for o in outputs] == expected
    assert all(rows == sorted(rows, reverse=True) for rows in decode_rows)
    assert any(len(set(rows)) > 1 for rows in decode_rows)   # rows of different lengths were ordered


def test_prefix_cache_hits_and_agrees(tiny_checkpoint):
    """A shared 48-token prefix is served from the cache the second time, with identical output."""
    base = _prompts()[2] + _prompts()[1]
    prompts = [base + [11, 12, 13], base + [21, 22]]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        with LLM(EngineArgs(model=tiny_checkpoint("qwen3"), enable_prefix_caching=caching)) as llm:
            first = llm.generate([prompts[0]], params)
            second = llm.generate([prompts[1]], params)
            results[caching] = ([o.token_ids for o in first + second], second[0].usage.cached_tokens)
    assert results[True][0] == results[False][0]
    assert results[True][1] >= 32
    assert results[False][1] == 0


def test_requests_of_one_prompt_queued_together_compute_it_once(tiny_checkpoint):
    """Eight requests of one 70-token prompt queued before a step (``n`` choices): the first computes the
    prompt's full blocks, the others wait for them and take them from the cache; the tokens are those computed
    without the cache."""
    from pocketllm.engine.engine_core import EngineCore
    from pocketllm.loaders import hf_loader

    directory = tiny_checkpoint("llama")
    prompt = (_prompts()[2] * 3)[:70]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        core = EngineCore(EngineArgs(model=directory, device="cpu", num_kv_blocks=256, block_size=16,
                                     enable_prefix_caching=caching),
                          hf_loader.load_hf_config(directory),
                          hf_loader.SafetensorsWeights(hf_loader.safetensors_files(directory)), frozenset())
        requests = [core.add_request(f"r{i}", prompt, params) for i in range(8)]
        while core.has_work():
            core.step()
        results[caching] = [r.output_token_ids for r in requests], [r.num_cached_tokens for r in requests]
    tokens, cached = results[True]
    assert tokens == results[False][0]
    assert cached == [0] + [64] * 7, cached   # 4 full blocks of 16, computed once
    assert results[False][1] == [0] * 8


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hit_matches_transformers(arch, tiny_checkpoint, hf_reference):
    """A prompt whose first blocks come from the prefix cache is answered as transformers answers it."""
    directory = tiny_checkpoint(arch)
    shared = _prompts()[2] + _prompts()[1] + _prompts()[0]             # 55 tokens: 13 blocks of 4
    first, second = shared + [11, 12, 13], shared + [21, 22]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    with LLM(EngineArgs(model=directory, block_size=4, num_kv_blocks=256)) as llm:
        llm.generate([first], params)
        out = llm.generate([second], params)[0]
    assert out.usage.cached_tokens == 52, "the shared prefix's 13 full blocks come from the cache"
    assert out.token_ids == _reference_greedy(hf_reference, directory, arch, [second], 12)[0]
    reference = torch.log_softmax(hf_reference.logits(directory, second + out.token_ids, all_positions=True), -1)
    for i, entry in enumerate(out.logprobs):
        row = reference[len(second) - 1 + i]
        assert math.isclose(entry.logprob, row[entry.token_id].item(), abs_tol=1e-4)
        assert [alt.token_id for alt in entry.top] == torch.topk(row, 3).indices.tolist()
