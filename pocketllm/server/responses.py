"""``POST /v1/responses`` over the chat path: one chat request per response, its result retold as a response."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.responses_request import ResponsesRequest, responses_error
from pocketllm.server.response_events import ResponseEventWriter, sse_event
from pocketllm.server.response_objects import completed_response
from pocketllm.server.serving import Job, OpenAIServing

PREFIX = "resp"


class ResponsesServing:
    """Serves Responses requests through ``OpenAIServing``'s chat path (no state is kept between requests)."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, request: ResponsesRequest, disconnected: Callable[[], Any]) -> dict[str, Any]:
        """The whole response."""
        with _responses_params():
            completion = await self.serving.complete(request.chat, PREFIX, disconnected)
        return completed_response(completion, request, completion["id"], self.serving.model_name)

    async def prepare_stream(self, request: ResponsesRequest) -> Job:
        """Validate and register a streamed response before it starts (so errors are a 400); its chat stream
        ends with a usage chunk, which the last event carries."""
        with _responses_params():
            return await self.serving.prepare_stream(dataclasses.replace(request.chat, include_usage=True), PREFIX)

    async def stream(self, job: Job, request: ResponsesRequest) -> AsyncIterator[str]:
        """The typed events of the response, as server-sent events."""
        writer = ResponseEventWriter(request, job.request_id, self.serving.model_name)
        chunks = self.serving.stream_chunks(job)
        started = False
        try:
            # The chat stream is entered before the first event goes out, so that closing this stream (a client
            # that goes away) always closes it, which cancels the request and unregisters the job.
            async for chunk in chunks:
                events = [] if started else writer.start()
                started = True
                if chunk != "[DONE]":
                    events += writer.chunk(chunk)
                for event in events:
                    yield sse_event(event)
            for event in writer.finish():
                yield sse_event(event)
        finally:
            await chunks.aclose()


@contextmanager
def _responses_params() -> Iterator[None]:
    """Renames the ``param`` of a chat-path refusal to the Responses field it came from."""
    try:
        yield
    except InvalidRequestError as exc:
        raise responses_error(exc) from None
