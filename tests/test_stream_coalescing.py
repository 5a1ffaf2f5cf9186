"""A streaming reader that fell behind the engine sends one chunk for the tokens it has: the events that arrived
together are joined per choice (``TokenEvent.followed_by``, ``serving._coalesced``), and the stream still adds up
to the whole response (text, log-probabilities, finish)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pocketllm.outputs import TokenEvent, TokenLogprob


def _event(text: str, ids: list[int], finished: bool = False, reasoning: str = "") -> TokenEvent:
    logprobs = [TokenLogprob(i, str(i), -0.5) for i in ids]
    return TokenEvent("r", text, ids, finished, "length" if finished else None, logprobs=logprobs,
                      reasoning_content=reasoning)


def test_events_join_in_order_and_the_later_one_ends():
    joined = _event("a", [1]).followed_by(_event("b", [2, 3], finished=True))
    assert joined is not None
    assert (joined.text, joined.token_ids, joined.finished, joined.finish_reason) == ("ab", [1, 2, 3], True, "length")
    assert [entry.token_id for entry in joined.logprobs] == [1, 2, 3]
    assert _event("a", [1], finished=True).followed_by(_event("b", [2])) is None
    # reasoning may not follow answer text inside one chunk; answer text may follow reasoning
    assert _event("a", [1]).followed_by(_event("", [2], reasoning="think")) is None
    assert _event("", [1], reasoning="think").followed_by(_event("a", [2])).reasoning_content == "think"


def test_coalesced_joins_each_choice_apart():
    from pocketllm.server.serving import _coalesced

    class Choice:
        def __init__(self, index: int) -> None:
            self.index = index

    first, second = Choice(0), Choice(1)
    failure = RuntimeError("boom")
    ready = [(first, _event("a", [1])), (second, _event("x", [7])), (first, _event("b", [2])),
             (second, failure), (second, _event("y", [8])), (first, _event("c", [3], finished=True))]
    joined = _coalesced(ready)
    assert [(c.index, e.text if isinstance(e, TokenEvent) else e) for c, e in joined] == [
        (0, "abc"), (1, "x"), (1, failure), (1, "y")]
    assert joined[0][1].finished and joined[0][1].token_ids == [1, 2, 3]


class _BehindLLM:
    """An AsyncLLM whose streams hand every event over at once, as to a reader that fell behind."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def open_stream(self, *args: Any, **kwargs: Any):
        events = await self._llm.open_stream(*args, **kwargs)
        held = [event async for batch in events for event in batch]

        async def at_once():
            yield held

        return at_once()


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_stream_behind_the_engine_sends_one_chunk_and_adds_up(endpoint, tiny_checkpoint):
    from pocketllm.api import AsyncLLM
    from pocketllm.config import EngineArgs
    from pocketllm.protocol.openai_fields import parse_chat_request, parse_completion_request
    from pocketllm.server.metrics import ServerMetrics
    from pocketllm.server.serving import OpenAIServing

    body: dict[str, Any] = {"model": "x", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    if endpoint == "chat":
        body |= {"messages": [{"role": "user", "content": "Name a colour."}], "logprobs": True, "top_logprobs": 2}
    else:
        body |= {"prompt": "The sky is", "logprobs": 2}

    async def main() -> tuple[list[dict], dict]:
        async with AsyncLLM(EngineArgs(model=tiny_checkpoint("llama"))) as llm:
            serving = OpenAIServing(_BehindLLM(llm), "x", ServerMetrics(lambda: None), None)
            parse = parse_chat_request if endpoint == "chat" else parse_completion_request
            async def connected() -> bool:
                return False

            whole = await serving.complete(parse(body, llm.engine_caps()), "whole", connected)
            job = await serving.prepare_stream(parse({**body, "stream": True}, llm.engine_caps()), "streamed")
            chunks = [c async for c in serving.stream_chunks(job) if isinstance(c, dict)]
        return chunks, whole

    chunks, whole = asyncio.run(main())
    choices = [c["choices"][0] for c in chunks if c.get("choices")]
    answer = whole["choices"][0]
    if endpoint == "chat":
        text = "".join(c["delta"].get("content", "") for c in choices)
        streamed = [e for c in choices if c["logprobs"] for e in c["logprobs"]["content"]]
        assert text == answer["message"]["content"]
        # the second run reads the prompt from the prefix cache: the same tokens, logits equal to rounding
        assert [e["token"] for e in streamed] == [e["token"] for e in answer["logprobs"]["content"]]
        assert [e["logprob"] for e in streamed] == pytest.approx([e["logprob"] for e in answer["logprobs"]["content"]],
                                                                 abs=1e-4)
        carrying = [c for c in choices if c["delta"].get("content")]
    else:
        text = "".join(c["text"] for c in choices)
        streamed = [t for c in choices if c["logprobs"] for t in c["logprobs"]["tokens"]]
        assert text == answer["text"]
        assert streamed == answer["logprobs"]["tokens"]
        carrying = [c for c in choices if c["text"]]
    assert len(streamed) == 12
    assert len(carrying) == 1, "twelve tokens that arrived together go out as one chunk"
    assert choices[-1]["finish_reason"] == answer["finish_reason"] == "length"
