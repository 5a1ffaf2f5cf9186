"""The start-up warm-up (``EngineCore.warm_up``, run on CUDA when the engine is built) leaves no trace: counters,
KV blocks, the prefix cache, state slots and the shared sampling generator are as a fresh engine's."""

from __future__ import annotations

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams

PROMPTS = [[101, 2001, 3003, 4004, 5005, 6006, 707], [5, 6, 7, 8] * 6]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=12, temperature=0.9, ignore_eos=True)


def _run(args: EngineArgs, warm: bool) -> tuple[list[list[int]], list[list[int]], dict, dict]:
    with LLM(args) as llm:
        core = llm._client.backend.core
        if warm:
            launched = []
            launch = core.launch
            core.launch = lambda: launched.append(1) or launch()
            core.warm_up()
            del core.launch
            assert len(launched) >= 4   # two prefill waves, then decode steps until the four requests finish
        before = llm.stats()
        greedy = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        sampled = [o.token_ids for o in llm.generate(PROMPTS, UNSEEDED)]
        return greedy, sampled, before, llm.stats()


@pytest.mark.parametrize("arch,extra", [
    ("llama", {"async_scheduling": "on"}),
    ("llama", {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}),
    ("qwen3_5_text", {}),
])
def test_warm_up_leaves_the_engine_as_new(arch, extra, tiny_checkpoint):
    args = EngineArgs(model=tiny_checkpoint(arch), backend="torch", seed=7, num_kv_blocks=64, **extra)
    fresh = _run(args, warm=False)
    warmed = _run(args, warm=True)
    greedy, sampled, before, after = warmed
    assert before["num_steps"] == 0 and before["kv_cache_free_blocks"] == before["kv_cache_total_blocks"]
    assert before["prefix_cache_queries"] == 0 and before["num_requests_running"] == 0
    assert before["spec_verify_chunks"] == 0
    assert (greedy, sampled) == fresh[:2]          # the shared generator was not drawn from
    assert after == fresh[3]
