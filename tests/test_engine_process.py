"""The engine in a process of its own (``engine_process=True``): the same outputs as in-process, commands,
cancellation, and what the client does when the engine process dies."""

from __future__ import annotations

import os
import signal
import time

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import EngineDeadError, InvalidRequestError

PROMPT = [101, 2001, 3003, 4004, 5005, 6006, 707]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def pair(model_dir):
    """An in-process and an engine-process ``LLM`` over the same checkpoint."""
    with LLM(EngineArgs(model=model_dir, max_num_seqs=8)) as local, \
            LLM(EngineArgs(model=model_dir, max_num_seqs=8, engine_process=True)) as remote:
        yield local, remote


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def _assert_same_logprobs(a, b) -> None:
    """Same ranked tokens; values equal up to float summation order (the two processes may run with
    different intra-op thread counts, which reorders reductions in the last bits)."""
    for x, y in zip(a, b):
        assert (x.logprobs is None) == (y.logprobs is None)
        for p, q in zip(x.logprobs or (), y.logprobs or ()):
            assert (p.token_id, p.token) == (q.token_id, q.token)
            assert p.logprob == pytest.approx(q.logprob, abs=1e-4)
            assert [t.token_id for t in p.top] == [t.token_id for t in q.top]
            assert [t.logprob for t in p.top] == pytest.approx([t.logprob for t in q.top], abs=1e-4)


def test_outputs_equal_the_in_process_engine(pair):
    local, remote = pair
    params = [_greedy(12, ignore_eos=True), _greedy(12, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=12, temperature=0.9, seed=7, ignore_eos=True)]
    for p in params:
        a = local.generate(["Once upon a time", PROMPT], p)
        b = remote.generate(["Once upon a time", PROMPT], p)
        assert [(o.text, o.token_ids, o.finish_reason) for o in a] == \
            [(o.text, o.token_ids, o.finish_reason) for o in b]
        _assert_same_logprobs(a, b)
        assert [o.usage.completion_tokens for o in a] == [o.usage.completion_tokens for o in b]
    stream = list(remote.generate_stream("Once upon a time", params[0]))
    assert "".join(e.text for e in stream) == local.generate("Once upon a time", params[0])[0].text
    assert stream[-1].finished and not any(e.finished for e in stream[:-1])


def test_stop_strings_and_stop_tokens_match(pair):
    local, remote = pair
    full = local.generate("Once upon a time", _greedy(24, ignore_eos=True))[0]
    stop = full.text[3:6]
    for p in (_greedy(24, ignore_eos=True, stop=[stop]),
              _greedy(24, ignore_eos=True, stop_token_ids=[full.token_ids[4]])):
        a = local.generate("Once upon a time", p)[0]
        b = remote.generate("Once upon a time", p)[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason, a.usage.completion_tokens) == \
            (b.text, b.token_ids, b.finish_reason, b.stop_reason, b.usage.completion_tokens)
        streamed = "".join(e.text for e in remote.generate_stream("Once upon a time", p))
        assert streamed == a.text
    # The request a stop string ended is released by the engine too: its id can be used again.
    remote.generate("Once upon a time", _greedy(24, ignore_eos=True, stop=[stop]), request_id="again")
    deadline = time.monotonic() + 10
    while remote.stats()["num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert remote.stats()["num_requests_running"] == 0
    assert remote.generate("Once upon a time", _greedy(2), request_id="again")[0].finish_reason


def test_chat_cancel_duplicates_and_errors(pair):
    local, remote = pair
    messages = [{"role": "user", "content": "Hi"}]
    assert remote.chat(messages, _greedy(6, ignore_eos=True))[0].text == \
        local.chat(messages, _greedy(6, ignore_eos=True))[0].text
    events = remote.generate_stream(PROMPT, _greedy(10_000, ignore_eos=True), request_id="long")
    next(events)
    assert remote.is_active("long")
    with pytest.raises(InvalidRequestError):
        remote.generate([PROMPT], _greedy(2), request_id="long")
    assert remote.cancel("long") is True
    assert list(events)[-1].finish_reason == "cancelled"
    assert remote.cancel("long") is False and not remote.is_active("long")
    with pytest.raises(InvalidRequestError):
        remote.generate([PROMPT * 10_000], _greedy(2))
    assert len(remote.generate([PROMPT], _greedy(3, ignore_eos=True))[0].token_ids) == 3


def test_commands_stats_and_metadata(pair):
    local, remote = pair
    remote.set_prefill_token_budget(16)
    remote.set_prefill_token_budget(0)
    with pytest.raises(InvalidRequestError):
        remote.set_prefill_token_budget(-1)
    stats = remote.stats()
    assert stats.keys() == local.stats().keys() and stats["num_steps"] > 0
    assert remote.engine_caps() == local.engine_caps()
    assert remote.max_model_len == local.max_model_len and remote.model_info() == local.model_info()
    assert remote.engine_error is None


def test_prefix_export_and_import_cross_the_pipe(pair):
    _, remote = pair
    ids = list(range(100, 164))
    remote.generate([ids], _greedy(1))
    snapshot = remote.export_prefix(ids)
    assert snapshot.num_tokens >= 32
    assert remote.import_prefix(snapshot) == snapshot.num_tokens


def test_a_killed_engine_process_fails_requests_and_reports_it(model_dir):
    llm = LLM(EngineArgs(model=model_dir, engine_process=True))
    try:
        events = llm.generate_stream(PROMPT, _greedy(10_000, ignore_eos=True))
        next(events)
        os.kill(llm.engine_client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            list(events)
        assert isinstance(llm.engine_error, EngineDeadError)
        with pytest.raises(EngineDeadError):
            llm.generate([PROMPT], _greedy(2))
    finally:
        llm.shutdown()
