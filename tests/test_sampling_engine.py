"""Sampling through the engine: seeds, log-probabilities against HF, penalties and bias end to end."""

from __future__ import annotations

import math

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.scheduler_api import BatchScheduler


@pytest.fixture(scope="module", params=["off", "on"], ids=["sync", "async-scheduling"])
def llm(request, tiny_checkpoint):
    """Every test runs with step N+1 launched after step N's tokens are read (sync) and before (async)."""
    with LLM(EngineArgs(model=tiny_checkpoint("llama"), async_scheduling=request.param)) as engine:
        yield engine


PROMPT = [101, 2001, 3003, 4004, 5005, 6006, 707]


def test_seeded_sampling_same_alone_and_in_mixed_batch(llm):
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].token_ids
    others = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = []
    import threading

    def run(prompt, params):
        outputs.append((params is seeded, llm.generate([prompt], params)[0].token_ids))

    threads = [threading.Thread(target=run, args=(p, s)) for p, s in
               [([5, 6, 7, 8], others), (PROMPT, seeded), ([9, 10] * 10, greedy), ([77] * 3, others)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mixed = [ids for is_seeded, ids in outputs if is_seeded]
    assert mixed == [alone]
    assert llm.generate([PROMPT], seeded)[0].token_ids == alone
    different = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    assert llm.generate([PROMPT], different)[0].token_ids != alone


def test_greedy_logprobs_equal_hf_log_softmax(llm, tiny_checkpoint, hf_reference):
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=5, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 12
    logits = hf_reference.logits(tiny_checkpoint("llama"), PROMPT + out.token_ids, all_positions=True)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, entry in enumerate(out.logprobs):
        row = reference[len(PROMPT) - 1 + i]
        assert entry.token_id == out.token_ids[i]
        assert math.isclose(entry.logprob, row[entry.token_id].item(), abs_tol=1e-4)
        top = torch.topk(row, 5)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        for alt, value in zip(entry.top, top.values.tolist()):
            assert math.isclose(alt.logprob, value, abs_tol=1e-4)
        assert entry.top[0].token_id == entry.token_id


def test_logit_bias_forces_a_token(llm):
    params = SamplingParams(max_tokens=5, temperature=0.0, logit_bias={4242: 100.0}, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == [4242] * 5


def test_repetition_penalty_matches_transformers(llm, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                             min_new_tokens=16, repetition_penalty=1.8, pad_token_id=0)
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.8, ignore_eos=True)
    assert llm.generate([PROMPT], params)[0].token_ids == ref[0, len(PROMPT):].tolist()


# A KV pool of 20 blocks of 4 tokens (80 tokens) for four requests that need about 170: some are preempted.
PREEMPTION = {"num_kv_blocks": 20, "block_size": 4, "max_num_batched_tokens": 24}
OTHER_PROMPTS = [[(1000 + 7919 * (i + 1) * (n + 3)) % 49152 for i in range(length)]
                 for n, length in enumerate((17, 33, 9))]


@pytest.mark.parametrize("async_scheduling", ["off", "on"], ids=["sync", "async-scheduling"])
def test_seeded_request_reproduces_across_preemption(async_scheduling: str, tiny_checkpoint) -> None:
    """A seeded sampled request that is preempted (and recomputed) while others run gives its tokens alone."""
    seeded = SamplingParams(max_tokens=32, temperature=1.0, seed=4321, ignore_eos=True)
    unseeded = SamplingParams(max_tokens=32, temperature=0.9, ignore_eos=True)
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=tiny_checkpoint("llama"), async_scheduling=async_scheduling, **PREEMPTION)) as llm:
        alone = llm.generate([PROMPT], seeded)[0].token_ids
        assert llm.stats()["num_preemptions"] == 0, "the request alone fits the pool"
        scheduler = llm._client.backend.core.scheduler
        preempt = scheduler._preempt
        preempted: list[str] = []

        def recording_preempt(victim) -> None:
            preempted.append(victim.request_id)
            preempt(victim)

        scheduler._preempt = recording_preempt
        batch = BatchScheduler(llm, max_batch_size=4)
        # Submitted last, the seeded request is the newest running one: the first victim of a preemption.
        ids = [batch.submit_request(prompt, params, request_id=f"other-{i}")
               for i, (prompt, params) in enumerate(zip(OTHER_PROMPTS, (unseeded, unseeded, greedy)))]
        ids.append(batch.submit_request(PROMPT, seeded, request_id="seeded"))
        outputs = [batch.poll_result(request_id, timeout_ms=120_000) for request_id in ids]
        assert llm.stats()["num_preemptions"] > 0
    assert "seeded" in preempted, "the seeded request itself was meant to be preempted"
    assert outputs[-1].token_ids == alone
    assert all(len(out.token_ids) == 32 for out in outputs)
