"""Prompt-lookup speculation on the native plane (pocketllm_cpp.QwenBatchCore, and backend='cpp' with
speculative_config method 'ngram'): the tokens equal plain decoding, greedy and seeded, on Qwen3 and Qwen3.5
(whose recurrent state is put back after a rejection), batched, under preemption, with stop tokens, token budgets
and log-probabilities; proposals are both kept and rejected."""

from __future__ import annotations

import pytest
from native_utils import greedy_sampling, small_engine

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import UnsupportedFeatureError

# Repetitive prompts give the lookup something to find; the last one has no repeat in it.
PROMPTS = [list(range(300, 310)) * 3, [5, 17, 301, 42, 9] * 4 + [7], [88, 12, 3, 4000, 51]]
ARCHS = ["qwen3", "qwen3_5_text", "qwen3_5_moe_text"]
pytestmark = pytest.mark.usefixtures("one_thread")   # the engines set libtorch's (process-wide) thread count
# Tiny random models rarely repeat themselves; a bias to four tokens makes the (still model-chosen) output a run
# over them, where lookups find proposals that are sometimes right and sometimes wrong.
BIAS = [(301, 30.0), (42, 30.0), (9, 30.0), (4000, 30.0)]


def _run(native, engine, prompts, speculate, slots=4, budget=None, **fields):
    """Every prompt's events through one batch core: ({index: [event, ...]}, the core's stats)."""
    core = native.QwenBatchCore(engine, slots)
    if budget is not None:
        core.set_prefill_token_budget(budget)
    if speculate:
        core.set_ngram_speculation(speculate, 1, 3)
    for i, prompt in enumerate(prompts):
        core.add(f"r{i}", prompt, greedy_sampling(native, **fields))
    events: dict[int, list] = {i: [] for i in range(len(prompts))}
    for _ in range(10000):
        if not core.has_work():
            return events, core.stats()
        for event in core.step():
            events[int(event.request_id[1:])].append(event)
    raise AssertionError("the batch core did not finish")


def _tokens(events):
    return [[e.token for e in events[i]] for i in range(len(events))]


@pytest.fixture(scope="module", params=ARCHS)
def arch_engine(native, tiny_checkpoint, request):
    return request.param, small_engine(native, tiny_checkpoint(request.param))


def test_greedy_tokens_equal_plain_decoding(native, arch_engine):
    _, engine = arch_engine
    plain, _ = _run(native, engine, PROMPTS, 0, max_new_tokens=40, logit_bias=BIAS)
    spec, stats = _run(native, engine, PROMPTS, 4, max_new_tokens=40, logit_bias=BIAS)
    assert _tokens(spec) == _tokens(plain)
    assert all(len(t) == 40 for t in _tokens(spec))
    # Proposals were made, some kept and some rejected, and the steps fewer than tokens.
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"] > 0
    assert stats["spec_verify_chunks"] > 0
    assert [e.completion_tokens for e in spec[0]] == list(range(1, 41))
    assert spec[0][-1].finish_reason == "length"


def test_seeded_sampling_draws_the_same_tokens(native, arch_engine):
    """Each emitted token takes one draw of the request's stream, as in plain decoding. A bias to three tokens
    makes the draws random among them, so that proposals of earlier draws are sometimes drawn again."""
    _, engine = arch_engine
    fields = {"max_new_tokens": 30, "temperature": 1.0, "seed": 1234, "logit_bias": BIAS}
    plain, _ = _run(native, engine, PROMPTS, 0, **fields)
    spec, stats = _run(native, engine, PROMPTS, 3, **fields)
    assert _tokens(spec) == _tokens(plain)
    assert len(set(_tokens(plain)[2])) > 1
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"] > 0


def test_stop_tokens_budgets_and_logprobs(native, arch_engine):
    _, engine = arch_engine
    plain, _ = _run(native, engine, PROMPTS, 0, max_new_tokens=25, logit_bias=BIAS)
    # The stop token: the output token whose first appearance comes latest (after some proposals were kept).
    first = {}
    for tokens in _tokens(plain):
        for index, token in enumerate(tokens):
            first.setdefault(token, index)
    stop = max(first, key=first.get)
    assert first[stop] >= 2
    fields = {"max_new_tokens": 25, "logprobs": 3, "stop_token_ids": [stop], "logit_bias": BIAS}
    plain, _ = _run(native, engine, PROMPTS, 0, **fields)
    spec, stats = _run(native, engine, PROMPTS, 4, **fields)
    assert _tokens(spec) == _tokens(plain) and stats["spec_accepted_tokens"] > 0
    assert any(events[-1].token == stop and events[-1].eos and events[-1].finish_reason == "stop"
               for events in spec.values())
    for i in spec:
        for mine, theirs in zip(spec[i], plain[i]):
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert list(mine.top_ids) == list(theirs.top_ids)
            assert list(mine.top_logprobs) == pytest.approx(list(theirs.top_logprobs), abs=1e-4)
    # A budget in the middle of a run of kept proposals is still exact.
    for budget in (1, 2, 7):
        spec, _ = _run(native, engine, PROMPTS, 4, max_new_tokens=budget, logit_bias=BIAS)
        assert [len(t) for t in _tokens(spec)] == [budget] * len(PROMPTS)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_preemption_under_speculation(native, tiny_checkpoint, arch):
    engine = small_engine(native, tiny_checkpoint(arch), block_size=4, num_kv_blocks=24)
    reference = small_engine(native, tiny_checkpoint(arch))
    plain, _ = _run(native, reference, PROMPTS, 0, max_new_tokens=24, logit_bias=BIAS)
    spec, stats = _run(native, engine, PROMPTS, 4, slots=3, max_new_tokens=24, logit_bias=BIAS)
    assert _tokens(spec) == _tokens(plain)
    assert stats["num_preemptions"] > 0 and stats["spec_accepted_tokens"] > 0


@pytest.mark.parametrize("budget", [7, 3])
def test_chunked_prompts_ending_on_a_block_boundary(native, tiny_checkpoint, budget):
    """A Qwen3.5 prompt that ends on a block boundary keeps a state at its end, so its prefill stops there; its
    first output is a plain row (no proposals before the prompt is done), and the prompts' kept states and the
    tokens and log-probabilities are those of plain decoding."""
    path = tiny_checkpoint("qwen3_5_text")
    prompts = [[301, 42, 9, 4000] * 2, [301, 42, 9, 4000, 42, 9, 301, 301]]
    results = []
    for speculate in (0, 4):
        engine = small_engine(native, path, block_size=4)
        events, stats = _run(native, engine, prompts, speculate, max_new_tokens=16, logprobs=2, logit_bias=BIAS,
                             budget=budget)
        results.append((_tokens(events), [[e.logprob for e in events[i]] for i in events],
                        engine.num_state_snapshots, stats))
    (plain, plain_lp, plain_kept, _), (spec, spec_lp, spec_kept, stats) = results
    # Both keep the prompts' 3 states (the shared first block's, each end); plain decoding also keeps each
    # sequence's last decoded block boundary, which verify chunks mostly pass without a step ending on it.
    assert spec == plain and 3 <= spec_kept <= plain_kept == 5 and stats["spec_accepted_tokens"] > 0
    for mine, theirs in zip(spec_lp, plain_lp):
        assert mine == pytest.approx(theirs, abs=1e-4)


def test_bad_speculation_settings_are_refused(native, arch_engine):
    _, engine = arch_engine
    core = native.QwenBatchCore(engine, 2)
    for args, message in [((-1, 1, 3), "num_speculative_tokens"), ((2, 0, 3), "prompt_lookup"),
                          ((2, 4, 3), "must not exceed")]:
        with pytest.raises(ValueError, match=message):
            core.set_ngram_speculation(*args)


def test_the_scheduler_speculates_and_declares_it(native, arch_engine):
    _, engine = arch_engine
    plain, _ = _run(native, engine, PROMPTS[:2], 0, max_new_tokens=20, logit_bias=BIAS)
    scheduler = native.QwenBatchScheduler(engine, max_batch_size=2)
    try:
        assert list(scheduler.engine_caps().speculative) == []
        scheduler.set_ngram_speculation(3, 1, 3)
        assert list(scheduler.engine_caps().speculative) == ["ngram"]
        with pytest.raises(ValueError, match="prompt_lookup_min"):
            scheduler.set_ngram_speculation(3, 3, 1)
        ids = [scheduler.submit_request(p, greedy_sampling(native, 20, logit_bias=BIAS)) for p in PROMPTS[:2]]
        results = [scheduler.poll_result(i, timeout_ms=60000) for i in ids]
        assert [r.tokens for r in results] == _tokens(plain)
        assert scheduler.stats()["spec_accepted_tokens"] > 0
    finally:
        scheduler.stop()


def test_backend_cpp_speculates_by_prompt_lookup(native, tiny_checkpoint):
    model = tiny_checkpoint("qwen3_5_text")
    prompts = ["a b c d a b c d a b c d a b", "1, 2, 3, 1, 2, 3, 1, 2,"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=model, backend="torch")) as torch_llm:
        expected = [o.token_ids for o in torch_llm.generate(prompts, params)]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(EngineArgs(model=model, backend="cpp", cpu_kv_cache_gb=0.05, speculative_config=spec)) as llm:
        assert llm.engine_caps().speculative == ("ngram",)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        stream = list(llm.generate(prompts[0], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                                stop=["zzz"])))
        assert stream[0].token_ids == expected[0]
    for refused in ({"method": "mtp", "num_speculative_tokens": 1},
                    {"method": "draft_model", "model": model, "num_speculative_tokens": 2}):
        with pytest.raises(UnsupportedFeatureError, match="speculative_config"):
            LLM(EngineArgs(model=model, backend="cpp", speculative_config=refused))
