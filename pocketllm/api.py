"""The library facade: ``LLM`` (blocking) and ``AsyncLLM`` (asyncio) over one backend."""

from __future__ import annotations

import asyncio
import itertools
import queue
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

from pocketllm.backends import create_backend
from pocketllm.backends.base import EngineCaps
from pocketllm.config import EngineArgs
from pocketllm.engine.output_processor import RequestStream
from pocketllm.errors import InvalidRequestError
from pocketllm.outputs import RequestOutput, TokenEvent
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.sampling_params import SamplingParams

Prompt = str | Sequence[int]


def _is_token_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt or a batch: a string, a list of token ids, or a list of either."""
    if isinstance(prompts, str) or _is_token_list(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts:
        for p in prompts:
            if not (isinstance(p, str) or _is_token_list(p)):
                raise InvalidRequestError("each prompt must be a string or a non-empty list of token ids",
                                          param="prompt")
        return list(prompts)
    raise InvalidRequestError("prompts must be a string, a list of token ids, or a non-empty list of them",
                              param="prompt")


class _EngineClient:
    """What LLM and AsyncLLM share: the backend, tokenisation, request ids and submission."""

    def __init__(self, args: EngineArgs | None, overrides: dict[str, Any]) -> None:
        if args is None:
            args = EngineArgs(**overrides)
        elif overrides:
            args = args.replace(**overrides)
        self.args = args
        self.backend = create_backend(args)
        self.tokenizer = self.backend.tokenizer
        self._counter = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    def engine_caps(self) -> EngineCaps:
        return self.backend.caps

    def new_request_id(self) -> str:
        return f"req-{self._prefix}-{next(self._counter)}"

    def request_ids(self, request_id: str | None, count: int) -> list[str]:
        """Ids for a batch: fresh ones, the caller's id, or the caller's id suffixed per prompt."""
        if request_id is None:
            return [self.new_request_id() for _ in range(count)]
        return [request_id] if count == 1 else [f"{request_id}-{i}" for i in range(count)]

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this checkpoint has no tokenizer; send token ids", param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The prompt text the checkpoint's own template makes of ``messages`` (options as ``chat``)."""
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError("this checkpoint has no tokenizer or chat template", param="messages")
        special = {"bos_token": tok.bos_token, "eos_token": tok.eos_token}
        return build_chat_prompt(tok.chat_template, messages, special_tokens=special, **options)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> list[int]:
        return self.tokenizer.encode(self.render_chat(messages, **options), add_special_tokens=False)

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str, emit, stream: bool):
        """Queue a request on the engine thread; returns the future of its acceptance."""
        tok = self.tokenizer
        decode = None
        token_text = None
        if tok is not None:
            skip = params.skip_special_tokens

            def decode(ids: Sequence[int]) -> str:
                return tok.decode(ids, skip_special_tokens=skip)

            token_text = tok.token_text
        sink = RequestStream(request_id, prompt_ids, params.stop, decode, token_text, emit, stream)
        return self.backend.loop.submit(request_id, prompt_ids, params, sink)

    def cancel(self, request_id: str) -> bool:
        return self.backend.loop.abort(request_id)

    def is_active(self, request_id: str) -> bool:
        return request_id in self.backend.loop.active

    def stats(self) -> dict[str, float | int]:
        return self.backend.core.stats()

    @property
    def max_model_len(self) -> int:
        return self.backend.core.max_model_len

    def set_prefill_token_budget(self, tokens: int) -> None:
        core = self.backend.core
        self.backend.loop.call(lambda: core.scheduler.set_prefill_chunk(tokens)).result()

    def shutdown(self) -> None:
        self.backend.shutdown()


def _stream_event(item: object) -> TokenEvent | None:
    """A streamed queue item as an event (None for the final output that follows it); errors are raised."""
    if isinstance(item, BaseException):
        raise item
    return item if isinstance(item, TokenEvent) else None


def _chat_options(options: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    request_id = options.pop("request_id", None)
    return request_id, options


class LLM:
    """Offline, blocking use of one model. Requests from many threads are batched together by the engine."""

    def __init__(self, args: EngineArgs | None = None, **overrides: Any) -> None:
        self._client = _EngineClient(args, overrides)

    @property
    def tokenizer(self):
        return self._client.tokenizer

    @property
    def args(self) -> EngineArgs:
        return self._client.args

    def engine_caps(self) -> EngineCaps:
        return self._client.engine_caps()

    def _run(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
             stream: bool) -> queue.SimpleQueue:
        results: queue.SimpleQueue = queue.SimpleQueue()
        self._client.submit(prompt_ids, params, request_id, results.put, stream).result()
        return results

    @staticmethod
    def _final(results: queue.SimpleQueue) -> RequestOutput:
        while True:
            item = results.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, RequestOutput):
                return item

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                 request_id: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (all submitted at once); outputs in prompt order."""
        params = params or SamplingParams()
        batch = _prompt_list(prompts)
        ids = [self._client.encode_prompt(p) for p in batch]
        names = self._client.request_ids(request_id, len(ids))
        pending = []
        try:
            for prompt_ids, name in zip(ids, names):
                pending.append((name, self._run(prompt_ids, params, name, stream=False)))
            return [self._final(results) for _, results in pending]
        except BaseException:
            for name, _ in pending:
                self._client.cancel(name)
            raise


    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                        request_id: str | None = None) -> Iterator[TokenEvent]:
        """Token events for one prompt; leaving the loop early cancels the request."""
        params = params or SamplingParams()
        return self._stream(self._client.encode_prompt(_prompt_list(prompt)[0]), params, request_id)

    def _stream(self, prompt_ids: list[int], params: SamplingParams,
                request_id: str | None) -> Iterator[TokenEvent]:
        name = request_id or self._client.new_request_id()
        results = self._run(prompt_ids, params, name, stream=True)
        finished = False
        try:
            while not finished:
                event = _stream_event(results.get())
                if event is not None:
                    finished = event.finished
                    yield event
        finally:
            if not finished:
                self._client.cancel(name)

    def chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
             **options: Any) -> list[RequestOutput]:
        """One conversation rendered by the checkpoint's own chat template; a one-element list."""
        request_id, options = _chat_options(options)
        prompt_ids = self._client.encode_chat(messages, **options)
        return self.generate([prompt_ids], params, request_id=request_id)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                    **options: Any) -> Iterator[TokenEvent]:
        request_id, options = _chat_options(options)
        prompt_ids = self._client.encode_chat(messages, **options)
        return self._stream(prompt_ids, params or SamplingParams(), request_id)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        return self._client.render_chat(messages, **options)

    def cancel(self, request_id: str) -> bool:
        """Cancel an active request at the next step boundary; False if it is unknown or finished."""
        return self._client.cancel(request_id)

    def shutdown(self) -> None:
        self._client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class AsyncLLM:
    """The same entry points as ``LLM`` as coroutines and async iterators, for asyncio applications."""

    def __init__(self, args: EngineArgs | None = None, **overrides: Any) -> None:
        self._client = _EngineClient(args, overrides)

    @property
    def tokenizer(self):
        return self._client.tokenizer

    def engine_caps(self) -> EngineCaps:
        return self._client.engine_caps()

    async def _run(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                   stream: bool) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        results: asyncio.Queue = asyncio.Queue()

        def emit(item: object) -> None:
            loop.call_soon_threadsafe(results.put_nowait, item)

        await asyncio.wrap_future(self._client.submit(prompt_ids, params, request_id, emit, stream))
        return results

    async def _final(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> RequestOutput:
        results = await self._run(prompt_ids, params, request_id, stream=False)
        try:
            item = await results.get()
        except asyncio.CancelledError:
            self._client.cancel(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    async def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> list[RequestOutput]:
        params = params or SamplingParams()
        batch = [self._client.encode_prompt(p) for p in _prompt_list(prompts)]
        names = self._client.request_ids(request_id, len(batch))
        return list(await asyncio.gather(*(self._final(p, params, n) for p, n in zip(batch, names))))

    async def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                              request_id: str | None = None) -> AsyncIterator[TokenEvent]:
        prompt_ids = self._client.encode_prompt(_prompt_list(prompt)[0])
        async for event in self._stream(prompt_ids, params or SamplingParams(), request_id):
            yield event

    async def _stream(self, prompt_ids: list[int], params: SamplingParams,
                      request_id: str | None) -> AsyncIterator[TokenEvent]:
        name = request_id or self._client.new_request_id()
        results = await self._run(prompt_ids, params, name, stream=True)
        finished = False
        try:
            while not finished:
                event = _stream_event(await results.get())
                if event is not None:
                    finished = event.finished
                    yield event
        finally:
            if not finished:
                self._client.cancel(name)

    async def chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                   **options: Any) -> list[RequestOutput]:
        request_id, options = _chat_options(options)
        prompt_ids = self._client.encode_chat(messages, **options)
        return await self.generate([prompt_ids], params, request_id=request_id)

    async def chat_stream(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                          **options: Any) -> AsyncIterator[TokenEvent]:
        request_id, options = _chat_options(options)
        prompt_ids = self._client.encode_chat(messages, **options)
        async for event in self._stream(prompt_ids, params or SamplingParams(), request_id):
            yield event

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        return self._client.render_chat(messages, **options)

    def cancel(self, request_id: str) -> bool:
        return self._client.cancel(request_id)

    def is_active(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running."""
        return self._client.is_active(request_id)

    def stats(self) -> dict[str, float | int]:
        """Engine load and cache counters (for metrics)."""
        return self._client.stats()

    @property
    def max_model_len(self) -> int:
        return self._client.max_model_len

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._client.shutdown)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
