"""The low-level scheduler API: submit token ids with callbacks (or poll), over an ``LLM``'s engine."""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from pocketllm.api import LLM
from pocketllm.backends.base import EngineCaps
from pocketllm.errors import EngineDeadError, InvalidRequestError
from pocketllm.outputs import RequestOutput, TokenEvent
from pocketllm.sampling_params import SamplingParams

logger = logging.getLogger("pocketllm.scheduler_api")

CompleteCallback = Callable[[RequestOutput], None]
TokenCallback = Callable[[str, int], None]


class _Pending:
    """One submitted request: its inputs, callbacks and, once done, its result."""

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams,
                 callback: CompleteCallback | None, on_token: TokenCallback | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.callback = callback
        self.on_token = on_token
        self.done = threading.Event()
        self.result: RequestOutput | None = None
        self.error: BaseException | None = None


class BatchScheduler:
    """Continuous batching for callers who want callbacks instead of the ``LLM`` facade.

    At most ``max_batch_size()`` requests run at once (clamped to the engine's slots); more wait here.
    Callbacks run on the engine thread: they must not block, and an exception they raise is logged and
    swallowed. Without callbacks, ``poll_result`` waits for a request's result.
    """

    def __init__(self, llm: LLM, max_batch_size: int = 4) -> None:
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise InvalidRequestError("max_batch_size must be a positive integer", param="max_batch_size")
        self._llm = llm
        self._client = llm.engine_client
        self._batch = min(max_batch_size, llm.engine_caps().max_slots)
        self._lock = threading.Lock()
        self._queued: deque[_Pending] = deque()
        self._running: set[str] = set()
        self._requests: dict[str, _Pending] = {}
        self._stopped = False

    def engine_caps(self) -> EngineCaps:
        return self._llm.engine_caps()

    def max_batch_size(self) -> int:
        return self._batch

    def set_prefill_token_budget(self, tokens: int) -> None:
        """Most prompt tokens one request prefills per step; 0 runs each prompt whole in one step."""
        self._llm.set_prefill_token_budget(tokens)

    def submit_request(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None, *,
                       callback: CompleteCallback | None = None, on_token: TokenCallback | None = None,
                       request_id: str | None = None) -> str:
        """Queue a request; returns its id at once."""
        if self._stopped:
            raise EngineDeadError("the scheduler has been stopped")
        prompt = list(prompt_tokens)
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequestError("prompt_tokens must be a non-empty list of token ids", param="prompt")
        pending = _Pending(request_id or self._client.new_request_id(), prompt, sampling or SamplingParams(),
                           callback, on_token)
        with self._lock:
            if pending.request_id in self._requests:
                raise InvalidRequestError(f"request id {pending.request_id!r} is already in use", param="request_id")
            self._requests[pending.request_id] = pending
            self._queued.append(pending)
        self._admit()
        return pending.request_id

    def poll_result(self, request_id: str, timeout_ms: int | None = None) -> RequestOutput | None:
        """The finished result, waiting up to ``timeout_ms`` (forever if None); None on timeout.

        A request the engine refused raises its error here; a cancelled one returns its partial result.
        """
        pending = self._requests.get(request_id)
        if pending is None:
            raise InvalidRequestError(f"unknown request id {request_id!r}", param="request_id")
        if not pending.done.wait(None if timeout_ms is None else timeout_ms / 1000.0):
            return None
        with self._lock:
            self._requests.pop(request_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            for pending in self._queued:
                if pending.request_id == request_id:
                    self._queued.remove(pending)
                    break
            else:
                pending = None
        if pending is not None:
            self._complete(pending, None)
            return True
        return self._llm.cancel(request_id)

    def stop(self) -> None:
        """Cancel everything queued or running and refuse new requests (the engine itself keeps running)."""
        self._stopped = True
        with self._lock:
            queued, self._queued = list(self._queued), deque()
            running = list(self._running)
        for pending in queued:
            self._complete(pending, None)
        for request_id in running:
            self._llm.cancel(request_id)
        for request_id in running:
            pending = self._requests.get(request_id)
            if pending is not None:
                pending.done.wait(30)

    def _admit(self) -> None:
        while True:
            with self._lock:
                if not self._queued or len(self._running) >= self._batch:
                    return
                pending = self._queued.popleft()
                self._running.add(pending.request_id)
            emit = self._emitter(pending)
            try:
                future = self._client.submit(pending.prompt, pending.params, pending.request_id, emit,
                                             stream=True)
            except Exception as exc:
                self._rejected(pending, exc)
                continue
            future.add_done_callback(
                lambda f, p=pending: f.exception() is not None and self._rejected(p, f.exception()))

    def _rejected(self, pending: _Pending, error: BaseException) -> None:
        logger.error("request %s was refused: %s", pending.request_id, error)
        pending.error = error
        with self._lock:
            self._running.discard(pending.request_id)
        self._complete(pending, None)
        self._admit()

    def _emitter(self, pending: _Pending) -> Callable[[object], None]:
        def emit(item: object) -> None:
            if isinstance(item, TokenEvent):
                if pending.on_token is not None:
                    for token in item.token_ids:
                        self._safely(pending.on_token, pending.request_id, token)
            elif isinstance(item, RequestOutput):
                with self._lock:
                    self._running.discard(pending.request_id)
                self._complete(pending, item)
                self._admit()
            elif isinstance(item, BaseException):
                with self._lock:
                    self._running.discard(pending.request_id)
                self._complete(pending, None)
        return emit

    def _complete(self, pending: _Pending, result: RequestOutput | None) -> None:
        pending.result = result
        pending.done.set()
        if pending.callback is not None and result is not None:
            self._safely(pending.callback, result)

    @staticmethod
    def _safely(fn: Callable, *args: object) -> None:
        try:
            fn(*args)
        except Exception:
            logger.exception("a scheduler callback raised; the exception was swallowed")
