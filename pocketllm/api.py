"""The library facade: ``LLM`` (blocking) and ``AsyncLLM`` (asyncio) over one backend."""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from functools import cached_property
from typing import Any

from pocketllm.backends import create_backend
from pocketllm.backends.base import EngineCaps
from pocketllm.backends.client_base import ClientBase, check_prefill_budget
from pocketllm.backends.proc_client import ProcessEngineClient
from pocketllm.config import EngineArgs
from pocketllm.engine.commands import ExportPrefix, ImportPrefix, SetPrefillBudget
from pocketllm.engine.kv_snapshot import KVSnapshot
from pocketllm.engine.model_info import ModelInfo
from pocketllm.errors import InvalidRequestError
from pocketllm.outputs import RequestOutput, TokenEvent
from pocketllm.protocol.chat_output import ChatOutputSpec
from pocketllm.request_builder import EngineRequest, Prompt, RequestBuilder
from pocketllm.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "EngineClient", "EngineRequest", "KVSnapshot", "ModelInfo", "ProcessEngineClient",
           "Prompt", "RequestBuilder"]


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


class EngineClient(ClientBase):
    """The facade's handle on the engine thread (``LLM.engine_client``): submission with an output callback,
    cancellation, the engine's commands, metadata and the request builder. Safe to use from any thread.
    ``ProcessEngineClient`` offers the same with the engine in a process of its own."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__()
        self.args = args
        self.backend = create_backend(args)
        self.tokenizer = self.backend.tokenizer
        caps = self.backend.caps
        self.builder = RequestBuilder(self.tokenizer, self.backend.core.max_model_len, caps.structured_outputs,
                                      caps.details.get("architecture"))

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving (None while it runs)."""
        return self.backend.loop.error

    def engine_caps(self) -> EngineCaps:
        return self.backend.caps

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               emit: Callable[[object], None], stream: bool, chat: ChatOutputSpec | None = None) -> Future:
        """Queue a request on the engine thread; returns the future of its acceptance.

        ``emit`` gets, on the engine thread, ``TokenEvent``s (when ``stream``), then the final ``RequestOutput``,
        or an exception. ``chat``: how a chat answer is split into reasoning, content and tool calls."""
        sink = self.request_stream(prompt_ids, params, request_id, emit, stream, chat)
        return self.backend.loop.submit(request_id, prompt_ids, params, sink)

    def cancel(self, request_id: str) -> bool:
        return self.backend.loop.abort(request_id)

    def is_active(self, request_id: str) -> bool:
        return request_id in self.backend.loop.active

    def stats(self) -> dict[str, float | int]:
        return self.backend.core.stats()

    def set_prefill_token_budget(self, tokens: int) -> Future:
        """Future of setting the most prompt tokens one request prefills per step (0: whole prompts)."""
        check_prefill_budget(tokens)
        return self.backend.loop.send(SetPrefillBudget(tokens))

    @property
    def model_path(self) -> str:
        return self.backend.model_path

    @property
    def generation_config(self) -> dict[str, Any]:
        return dict(self.backend.checkpoint.generation_config or {})

    @cached_property
    def model_info(self) -> ModelInfo:
        """Sizes, dtype and device of the model the engine runs (read once)."""
        return self.backend.model_info()

    def export_prefix(self, token_ids: Sequence[int], first_token: int = 0) -> Future:
        """Future of the ``KVSnapshot`` of the longest cached whole-block prefix of ``token_ids`` (from
        ``first_token`` on)."""
        return self.backend.loop.send(ExportPrefix([int(t) for t in token_ids], self.model_path, first_token))

    def import_prefix(self, snapshot: KVSnapshot) -> Future:
        """Future of the number of leading tokens of ``snapshot`` the prefix cache now serves."""
        if not isinstance(snapshot, KVSnapshot):
            raise InvalidRequestError("import_prefix takes a KVSnapshot (see export_prefix)", param="snapshot")
        return self.backend.loop.send(ImportPrefix(snapshot, self.model_path))

    def shutdown(self) -> None:
        self.backend.shutdown()


def make_client(args: EngineArgs | None, overrides: dict[str, Any]) -> EngineClient | ProcessEngineClient:
    """The engine client ``args`` ask for: the engine in a process of its own when ``engine_process`` is on,
    else on a thread of this process."""
    if args is None:
        args = EngineArgs(**overrides)
    elif overrides:
        args = args.replace(**overrides)
    if args.engine_process:
        return ProcessEngineClient(args)
    return EngineClient(args)


def _stream_event(item: object) -> TokenEvent | None:
    """A streamed queue item as an event (None for the final output that follows it); errors are raised."""
    if isinstance(item, BaseException):
        raise item
    return item if isinstance(item, TokenEvent) else None


class _LoopHandoff:
    """What the engine thread emits for one event loop, handed over in batches: one wake-up of the loop carries
    every item emitted since the previous wake-up, not one wake-up (a write to the loop's self-pipe and a
    callback) per token. Items reach their queues in the order they were emitted."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.lock = threading.Lock()
        self.items: list[tuple[_Inbox, object]] = []

    def put(self, results: _Inbox, item: object) -> None:
        """Called on the engine thread; raises RuntimeError once the loop is closed."""
        with self.lock:
            self.items.append((results, item))
            if len(self.items) > 1:   # a wake-up is already on its way and will carry this item
                return
        try:
            self.loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            with self.lock:
                self.items.clear()
            raise

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for results, item in items:
            results.put_nowait(item)


class _Inbox:
    """One request's delivered items on the event loop, read by one consumer: each ``get_all`` returns every
    item that has arrived, so a consumer that fell behind takes several tokens in one wake-up (and the
    wake-up costs one future, not a queue's getter bookkeeping per item)."""

    __slots__ = ("items", "waiter")

    def __init__(self) -> None:
        self.items: list[object] = []
        self.waiter: asyncio.Future | None = None

    def put_nowait(self, item: object) -> None:
        self.items.append(item)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get_all(self) -> list[object]:
        while not self.items:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        items, self.items = self.items, []
        return items


class _Facade:
    """What LLM and AsyncLLM expose alike without waiting on the engine: metadata, templates, cancellation."""

    def __init__(self, args: EngineArgs | None = None, **overrides: Any) -> None:
        self._client = make_client(args, overrides)

    @property
    def engine_client(self) -> EngineClient | ProcessEngineClient:
        """The engine handle beneath this facade, for lower-level front ends (``scheduler_api``)."""
        return self._client

    @property
    def request_builder(self) -> RequestBuilder:
        """What turns prompts and conversations into engine requests for this model."""
        return self._client.builder

    @property
    def tokenizer(self):
        return self._client.tokenizer

    @property
    def args(self) -> EngineArgs:
        return self._client.args

    @property
    def model_path(self) -> str:
        return self._client.model_path

    @property
    def generation_config(self) -> dict[str, Any]:
        return self._client.generation_config

    @property
    def max_model_len(self) -> int:
        return self._client.max_model_len

    def engine_caps(self) -> EngineCaps:
        return self._client.engine_caps()

    def model_info(self) -> ModelInfo:
        """Sizes, dtype and device of the model the engine runs."""
        return self._client.model_info

    def render_chat(self, messages: Sequence[Mapping[str, Any]], **options: Any) -> str:
        """The prompt text the checkpoint's own template makes of ``messages`` (options as ``chat``)."""
        return self._client.builder.render_chat(messages, **options)

    def prepare_chat(self, messages: Sequence[Mapping[str, Any]],
                     **options: Any) -> tuple[list[int], ChatOutputSpec | None]:
        """Prompt ids and the answer's read-back spec (pass it to ``generate(..., chat_output=...)``)."""
        return self._client.builder.prepare_chat(messages, **options)

    def cancel(self, request_id: str) -> bool:
        """Cancel an active request at the next step boundary; False if it is unknown or finished."""
        return self._client.cancel(request_id)

    def is_active(self, request_id: str) -> bool:
        """Whether a request with this id is queued or running."""
        return self._client.is_active(request_id)

    def stats(self) -> dict[str, float | int]:
        """Engine load and cache counters (for metrics)."""
        return self._client.stats()

    @property
    def engine_error(self) -> BaseException | None:
        """Why the engine stopped serving (it crashed, or its process exited); None while it runs."""
        return self._client.error

    def _build(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None) -> list[EngineRequest]:
        builder = self._client.builder
        return [builder.build(params, prompt=p) for p in _prompt_list(prompts)]

    def _build_chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None,
                    options: dict[str, Any]) -> tuple[str | None, EngineRequest]:
        """The caller's request id (an option) and the conversation's engine request."""
        request_id = options.pop("request_id", None)
        return request_id, self._client.builder.build(params, messages=messages, chat_options=options)


class LLM(_Facade):
    """Offline, blocking use of one model. Requests from many threads are batched together by the engine."""

    def _run(self, request: EngineRequest, request_id: str, stream: bool,
             chat: ChatOutputSpec | None = None) -> queue.SimpleQueue:
        results: queue.SimpleQueue = queue.SimpleQueue()
        self._client.submit(request.prompt_ids, request.params, request_id, results.put, stream, chat).result()
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
                 request_id: str | None = None, chat_output: ChatOutputSpec | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a batch (all submitted at once); outputs in prompt order.

        ``chat_output`` (from ``prepare_chat``): split each answer into reasoning, content and tool calls."""
        return self._generate(self._build(prompts, params), request_id, chat_output)

    def _generate(self, requests: list[EngineRequest], request_id: str | None,
                  chat_output: ChatOutputSpec | None) -> list[RequestOutput]:
        names = self._client.request_ids(request_id, len(requests))
        pending = []
        try:
            for request, name in zip(requests, names):
                pending.append((name, self._run(request, name, stream=False, chat=chat_output)))
            return [self._final(results) for _, results in pending]
        except BaseException:
            for name, _ in pending:
                self._client.cancel(name)
            raise

    def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                        request_id: str | None = None) -> Iterator[TokenEvent]:
        """Token events for one prompt; leaving the loop early cancels the request."""
        return self._stream(self._build(_prompt_list(prompt)[0], params)[0], request_id)

    def _stream(self, request: EngineRequest, request_id: str | None,
                chat: ChatOutputSpec | None = None) -> Iterator[TokenEvent]:
        name = request_id or self._client.new_request_id()
        results = self._run(request, name, stream=True, chat=chat)
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
        request_id, request = self._build_chat(messages, params, options)
        return self._generate([request], request_id, request.chat_output)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                    **options: Any) -> Iterator[TokenEvent]:
        request_id, request = self._build_chat(messages, params, options)
        return self._stream(request, request_id, request.chat_output)

    def set_prefill_token_budget(self, tokens: int) -> None:
        """Most prompt tokens one request prefills per step; 0 runs each prompt whole in one step."""
        self._client.set_prefill_token_budget(tokens).result()

    def export_prefix(self, token_ids: Sequence[int], first_token: int = 0) -> KVSnapshot:
        """The KV of the longest prefix of ``token_ids`` held in whole cached blocks (``snapshot.save(path)``
        writes it as safetensors; ``KVSnapshot.load(path)`` reads it back). With ``first_token`` (a multiple
        of the block size) only the blocks from there on: an increment, joined to the parts before it with
        ``KVSnapshot.join`` before import."""
        return self._client.export_prefix(token_ids, first_token).result()

    def import_prefix(self, snapshot: KVSnapshot) -> int:
        """Put a snapshot's blocks into the prefix cache (refused if made by another model, dtype or block
        size); returns how many leading tokens of it later requests will find cached."""
        return self._client.import_prefix(snapshot).result()

    def shutdown(self) -> None:
        self._client.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class AsyncLLM(_Facade):
    """The same entry points as ``LLM`` as coroutines and async iterators, for asyncio applications."""

    def __init__(self, args: EngineArgs | None = None, **overrides: Any) -> None:
        super().__init__(args, **overrides)
        self._handoffs: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopHandoff] = \
            weakref.WeakKeyDictionary()

    def _handoff(self) -> _LoopHandoff:
        loop = asyncio.get_running_loop()
        handoff = self._handoffs.get(loop)
        if handoff is None:
            handoff = self._handoffs[loop] = _LoopHandoff(loop)
        return handoff

    async def _run(self, request: EngineRequest, request_id: str, stream: bool,
                   chat: ChatOutputSpec | None = None) -> _Inbox:
        handoff = self._handoff()
        results = _Inbox()

        def emit(item: object) -> None:
            handoff.put(results, item)

        await asyncio.wrap_future(self._client.submit(request.prompt_ids, request.params, request_id, emit, stream,
                                                      chat))
        return results

    async def _final(self, request: EngineRequest, request_id: str,
                     chat: ChatOutputSpec | None = None) -> RequestOutput:
        results = await self._run(request, request_id, stream=False, chat=chat)
        try:
            item = (await results.get_all())[0]
        except asyncio.CancelledError:
            self._client.cancel(request_id)
            raise
        if isinstance(item, BaseException):
            raise item
        return item

    async def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None, *,
                       request_id: str | None = None,
                       chat_output: ChatOutputSpec | None = None) -> list[RequestOutput]:
        return await self._generate(self._build(prompts, params), request_id, chat_output)

    async def _generate(self, requests: list[EngineRequest], request_id: str | None,
                        chat_output: ChatOutputSpec | None) -> list[RequestOutput]:
        names = self._client.request_ids(request_id, len(requests))
        return list(await asyncio.gather(*(self._final(r, n, chat_output) for r, n in zip(requests, names))))

    async def generate_stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                              request_id: str | None = None,
                              chat_output: ChatOutputSpec | None = None) -> AsyncIterator[TokenEvent]:
        request = self._build(_prompt_list(prompt)[0], params)[0]
        async for batch in self._stream_batches(request, request_id, chat_output):
            for event in batch:
                yield event

    async def generate_stream_batches(self, prompt: Prompt, params: SamplingParams | None = None, *,
                                      request_id: str | None = None, chat_output: ChatOutputSpec | None = None
                                      ) -> AsyncIterator[list[TokenEvent]]:
        """``generate_stream``'s events in lists: every event that had arrived when the caller asked for more
        (one list a token while the caller keeps up, several tokens in one list when it falls behind)."""
        request = self._build(_prompt_list(prompt)[0], params)[0]
        async for batch in self._stream_batches(request, request_id, chat_output):
            yield batch

    async def open_stream(self, prompt: Prompt, params: SamplingParams | None = None, *,
                          request_id: str | None = None, chat_output: ChatOutputSpec | None = None
                          ) -> AsyncIterator[list[TokenEvent]]:
        """Submit one request now and return its events in lists (as ``generate_stream_batches``): the request
        runs whether or not the caller has started reading. Read the iterator to its end or ``aclose`` it (which
        cancels the request)."""
        request = self._build(_prompt_list(prompt)[0], params)[0]
        name = request_id or self._client.new_request_id()
        return self._batches(await self._run(request, name, stream=True, chat=chat_output), name)

    async def _stream_batches(self, request: EngineRequest, request_id: str | None,
                              chat: ChatOutputSpec | None = None) -> AsyncIterator[list[TokenEvent]]:
        name = request_id or self._client.new_request_id()
        batches = self._batches(await self._run(request, name, stream=True, chat=chat), name)
        try:
            async for batch in batches:
                yield batch
        finally:
            await batches.aclose()

    async def _batches(self, results: _Inbox, name: str) -> AsyncIterator[list[TokenEvent]]:
        """A submitted request's events in lists of what had arrived; cancels the request if left early."""
        finished = False
        try:
            while not finished:
                batch: list[TokenEvent] = []
                for item in await results.get_all():
                    if isinstance(item, BaseException):
                        if batch:   # what came before the error goes out first
                            yield batch
                        raise item
                    if isinstance(item, TokenEvent) and not finished:
                        finished = item.finished
                        batch.append(item)
                if batch:
                    yield batch
        finally:
            if not finished:
                self._client.cancel(name)

    async def chat(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                   **options: Any) -> list[RequestOutput]:
        request_id, request = self._build_chat(messages, params, options)
        return await self._generate([request], request_id, request.chat_output)

    async def chat_stream(self, messages: Sequence[Mapping[str, Any]], params: SamplingParams | None = None,
                          **options: Any) -> AsyncIterator[TokenEvent]:
        request_id, request = self._build_chat(messages, params, options)
        async for batch in self._stream_batches(request, request_id, request.chat_output):
            for event in batch:
                yield event

    async def set_prefill_token_budget(self, tokens: int) -> None:
        """As ``LLM.set_prefill_token_budget``."""
        await asyncio.wrap_future(self._client.set_prefill_token_budget(tokens))

    async def export_prefix(self, token_ids: Sequence[int], first_token: int = 0) -> KVSnapshot:
        """As ``LLM.export_prefix``."""
        return await asyncio.wrap_future(self._client.export_prefix(token_ids, first_token))

    async def import_prefix(self, snapshot: KVSnapshot) -> int:
        """As ``LLM.import_prefix``."""
        return await asyncio.wrap_future(self._client.import_prefix(snapshot))

    async def shutdown(self) -> None:
        await asyncio.to_thread(self._client.shutdown)

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()
