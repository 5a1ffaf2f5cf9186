"""The library surface: termination, cancellation, streaming, concurrency, the scheduler API, errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pocketllm import (
    LLM,
    AsyncLLM,
    EngineArgs,
    InvalidRequestError,
    SamplingParams,
    UnsupportedFeatureError,
)
from pocketllm.scheduler_api import BatchScheduler

PROMPT = [101, 2001, 3003, 4004, 5005, 6006, 707]


@pytest.fixture(scope="module")
def model_dir(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def llm(model_dir):
    with LLM(EngineArgs(model=model_dir, max_num_seqs=32)) as engine:
        yield engine


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def _core(llm):
    return llm._client.backend.core


def test_eos_override_ends_generation_and_is_excluded(model_dir, llm):
    reference = llm.generate([PROMPT], _greedy(16, ignore_eos=True))[0].token_ids
    eos = reference[5]
    first = reference.index(eos)
    with LLM(EngineArgs(model=model_dir, backend_options={"eos_token_id": eos})) as custom:
        assert custom.engine_caps().details["eos_source"] == "backend_options"
        out = custom.generate([PROMPT], _greedy(16))[0]
        assert out.finish_reason == "stop"
        assert out.token_ids == reference[:first]
        assert eos not in out.token_ids
        assert out.usage.completion_tokens == first + 1, "usage counts the EOS step"
        streamed = list(custom.generate_stream(PROMPT, _greedy(16)))
        assert streamed[-1].finished and streamed[-1].finish_reason == "stop"
        assert streamed[-1].usage.completion_tokens == first + 1
        assert [t for e in streamed for t in e.token_ids] == reference[:first]


def test_non_integer_eos_override_is_refused(model_dir):
    for bad in ("2", 2.0, True, [1, "x"]):
        with pytest.raises(InvalidRequestError):
            LLM(EngineArgs(model=model_dir, backend_options={"eos_token_id": bad}))


def test_eos_source_reported(llm):
    assert llm.engine_caps().details["eos_source"] in ("generation_config", "config", "tokenizer")


def test_length_finish_and_stop_token_ids(llm):
    reference = llm.generate([PROMPT], _greedy(10, ignore_eos=True))[0]
    assert reference.finish_reason == "length" and len(reference.token_ids) == 10
    stop_id = reference.token_ids[3]
    out = llm.generate([PROMPT], _greedy(10, ignore_eos=True, stop_token_ids=[stop_id]))[0]
    cut = reference.token_ids.index(stop_id)
    assert out.finish_reason == "stop" and out.token_ids == reference.token_ids[:cut]
    assert out.stop_reason == stop_id


def test_stream_text_equals_generate_text(llm):
    params = _greedy(24, ignore_eos=True)
    whole = llm.generate("The quick brown fox", params)[0]
    events = list(llm.generate_stream("The quick brown fox", params))
    assert "".join(e.text for e in events) == whole.text
    assert [t for e in events for t in e.token_ids] == whole.token_ids
    assert events[-1].finished and not any(e.finished for e in events[:-1])


def test_stop_string_cuts_text_in_stream_and_whole(llm):
    params = _greedy(24, ignore_eos=True)
    full = llm.generate("Once upon a time", params)[0].text
    assert len(full) > 6
    stop = full[3:6]
    cut = full[: full.index(stop)]
    stopped = llm.generate("Once upon a time", _greedy(24, ignore_eos=True, stop=[stop]))[0]
    assert stopped.text == cut and stopped.finish_reason == "stop" and stopped.stop_reason == stop
    streamed = "".join(e.text for e in llm.generate_stream("Once upon a time",
                                                             _greedy(24, ignore_eos=True, stop=[stop])))
    assert streamed == cut


def test_cancel_restores_free_blocks(llm):
    core = _core(llm)
    free_before = core.blocks.num_free_blocks
    events = llm.generate_stream(PROMPT * 8, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True),
                                 request_id="to-cancel")
    next(events)
    assert llm.cancel("to-cancel") is True
    rest = list(events)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    assert llm.cancel("to-cancel") is False
    assert llm.cancel("never-existed") is False
    deadline = time.monotonic() + 5
    while core.blocks.num_free_blocks != free_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.blocks.num_free_blocks == free_before


def test_abandoned_stream_is_cancelled(llm):
    core = _core(llm)
    free_before = core.blocks.num_free_blocks
    events = llm.generate_stream(PROMPT, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
    next(events)
    events.close()
    deadline = time.monotonic() + 5
    while core.blocks.num_free_blocks != free_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.blocks.num_free_blocks == free_before


def test_64_concurrent_generate_calls(llm):
    results: list = [None] * 64
    expected = llm.generate([PROMPT], _greedy(8, ignore_eos=True))[0].token_ids

    def worker(i: int) -> None:
        results[i] = llm.generate([PROMPT], _greedy(8, ignore_eos=True))[0].token_ids

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == [expected] * 64


def test_async_llm_16_concurrent_streams(model_dir):
    async def main() -> list[str]:
        async with AsyncLLM(EngineArgs(model=model_dir)) as llm:
            async def one(i: int) -> str:
                parts = []
                async for event in llm.generate_stream(f"Story number {i}:", _greedy(12, ignore_eos=True)):
                    parts.append(event.text)
                return "".join(parts)

            streamed = await asyncio.gather(*(one(i) for i in range(16)))
            whole = await llm.generate([f"Story number {i}:" for i in range(16)], _greedy(12, ignore_eos=True))
            chat = await llm.chat([{"role": "user", "content": "Hi"}], _greedy(4, ignore_eos=True))
            chat_stream = [e async for e in llm.chat_stream([{"role": "user", "content": "Hi"}],
                                                             _greedy(4, ignore_eos=True))]
            assert chat[0].text == "".join(e.text for e in chat_stream)
            return list(streamed), [o.text for o in whole]

    streamed, whole = asyncio.run(main())
    assert streamed == whole


def test_open_stream_runs_before_it_is_read_and_hands_over_what_arrived_together(model_dir):
    async def main() -> None:
        async with AsyncLLM(EngineArgs(model=model_dir)) as llm:
            params = _greedy(12, ignore_eos=True)
            whole = (await llm.generate(PROMPT, params))[0]
            stream = await llm.open_stream(PROMPT, params, request_id="early")
            deadline = time.monotonic() + 60
            while llm.is_active("early"):   # the request runs to its end while nobody reads
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            batches = [batch async for batch in stream]
            assert len(batches) == 1, "everything that had arrived, in one list"
            assert [t for e in batches[0] for t in e.token_ids] == whole.token_ids and batches[0][-1].finished
            kept = [batch async for batch in llm.generate_stream_batches(PROMPT, params)]
            assert [t for b in kept for e in b for t in e.token_ids] == whole.token_ids
            left = await llm.open_stream(PROMPT, _greedy(4000, ignore_eos=True), request_id="left")
            first = await left.__anext__()
            assert first and llm.is_active("left")
            await left.aclose()   # leaving early cancels the request
            while llm.is_active("left"):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

    asyncio.run(main())


def test_chat_uses_template_and_token_prompts(llm):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = llm.render_chat(messages)
    assert rendered.startswith("<|im_start|>") and rendered.endswith("<|im_start|>assistant\n")
    chat = llm.chat(messages, _greedy(6, ignore_eos=True))
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    assert chat[0].prompt_token_ids == ids
    assert llm.generate([ids], _greedy(6, ignore_eos=True))[0].token_ids == chat[0].token_ids
    before = [dict(m) for m in messages]
    llm.chat(messages, _greedy(2))
    assert messages == before


def test_usage_as_dict(llm):
    out = llm.generate([PROMPT], _greedy(5, ignore_eos=True))[0]
    usage = out.usage.as_dict()
    assert usage["prompt_tokens"] == len(PROMPT) and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == len(PROMPT) + 5
    assert usage["prefill_time_s"] >= 0 and usage["decode_time_s"] >= 0


def test_request_errors_do_not_hurt_the_engine(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[10**9]], _greedy(2))
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPT * 10_000], _greedy(2))
    with pytest.raises(InvalidRequestError):
        llm.generate([], _greedy(2))
    assert len(llm.generate([PROMPT], _greedy(3, ignore_eos=True))[0].token_ids) == 3


def test_backend_and_args_validation(model_dir, tiny_checkpoint):
    with pytest.raises(UnsupportedFeatureError, match="native"):   # no Llama safetensors on the native plane
        LLM(EngineArgs(model=tiny_checkpoint("llama"), backend="cpp"))
    with pytest.raises(InvalidRequestError):
        EngineArgs(dtype="float8")
    with pytest.raises(InvalidRequestError):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(InvalidRequestError):
        LLM(EngineArgs(model=model_dir, backend_options={"no_such_knob": 1}))
    args = EngineArgs.from_env({"POCKETLLM_MAX_NUM_SEQS": "3", "POCKETLLM_ENABLE_PREFIX_CACHING": "off"},
                               model="x")
    assert args.max_num_seqs == 3 and args.enable_prefix_caching is False and args.model == "x"


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2}, {"max_tokens": 0}, {"logprobs": 21},
    {"stop": 5}, {"min_p": 2}, {"logit_bias": {"x": 1}}, {"repetition_penalty": 0}, {"seed": 1.5},
    {"seed": 2**64}, {"seed": -(2**63) - 1},   # past a 64-bit generator seed (was an error deep in the engine)
])
def test_sampling_params_reject_invalid_values(bad):
    with pytest.raises(InvalidRequestError):
        SamplingParams(**bad)


def test_scheduler_api_callbacks_and_polling(llm):
    scheduler = BatchScheduler(llm, max_batch_size=1000)
    assert scheduler.max_batch_size() == scheduler.engine_caps().max_slots
    done = threading.Event()
    tokens: list[int] = []
    results = []

    def on_token(request_id: str, token: int) -> None:
        tokens.append(token)

    def on_complete(result) -> None:
        results.append(result)
        done.set()
        raise RuntimeError("a callback that raises must not hurt the engine")

    expected = llm.generate([PROMPT], _greedy(6, ignore_eos=True))[0].token_ids
    scheduler.submit_request(PROMPT, _greedy(6, ignore_eos=True), callback=on_complete, on_token=on_token)
    assert done.wait(60)
    assert results[0].token_ids == expected == tokens
    polled_id = scheduler.submit_request(PROMPT, _greedy(6, ignore_eos=True))
    result = scheduler.poll_result(polled_id, timeout_ms=60_000)
    assert result is not None and result.token_ids == expected
    scheduler.set_prefill_token_budget(4)
    assert scheduler.poll_result(scheduler.submit_request(PROMPT, _greedy(6, ignore_eos=True)),
                                 timeout_ms=60_000).token_ids == expected
    scheduler.set_prefill_token_budget(0)
    assert scheduler.poll_result(scheduler.submit_request(PROMPT, _greedy(6, ignore_eos=True)),
                                 timeout_ms=60_000).token_ids == expected
    scheduler.set_prefill_token_budget(2048)
    slow = scheduler.submit_request(PROMPT, SamplingParams(max_tokens=100_000, temperature=0, ignore_eos=True))
    assert scheduler.poll_result(slow, timeout_ms=50) is None
    scheduler.stop()
    assert scheduler.poll_result(slow, timeout_ms=10_000).finish_reason == "cancelled"


def test_scheduler_api_limits_concurrency(llm):
    scheduler = BatchScheduler(llm, max_batch_size=2)
    core = _core(llm)
    seen: list[int] = []

    def on_token(request_id: str, token: int) -> None:
        seen.append(len(core.scheduler.running))

    ids = [scheduler.submit_request(PROMPT, _greedy(5, ignore_eos=True), on_token=on_token) for _ in range(6)]
    for request_id in ids:
        assert scheduler.poll_result(request_id, timeout_ms=60_000) is not None
    assert max(seen) <= 2
    scheduler.stop()


def test_duplicate_active_request_id_is_refused(llm):
    events = llm.generate_stream(PROMPT, SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True),
                                 request_id="dup")
    next(events)
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPT], _greedy(2), request_id="dup")
    assert llm.cancel("dup") is True
    assert list(events)[-1].finish_reason == "cancelled"
