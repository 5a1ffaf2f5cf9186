"""The engine in a process of its own: the client half, which stays in the caller's process.

The engine process (``engine_proc``) schedules, runs the model and samples; this side builds and tokenises
requests, detokenises the token ids each engine step sends (one message a step for all requests), matches stop
strings (cancelling the request in the engine when one matches) and shapes the outputs, so that this work no
longer competes with the engine's steps for one interpreter lock.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from multiprocessing.connection import wait
from typing import Any

from pocketllm.backends.base import EngineCaps
from pocketllm.backends.client_base import ClientBase, check_prefill_budget
from pocketllm.backends.engine_proc import run_engine
from pocketllm.config import EngineArgs
from pocketllm.engine.kv_snapshot import KVSnapshot
from pocketllm.engine.model_info import ModelInfo
from pocketllm.engine.output_processor import RequestStream
from pocketllm.engine.request import FinishReason
from pocketllm.errors import EngineDeadError, InvalidRequestError, UnsupportedFeatureError
from pocketllm.loaders.checkpoint import load_checkpoint
from pocketllm.loaders.default_model import default_model_path
from pocketllm.protocol.chat_output import ChatOutputSpec
from pocketllm.request_builder import RequestBuilder
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken

logger = logging.getLogger("pocketllm.engine")

STATS_TIMEOUT_S = 10.0
SHUTDOWN_TIMEOUT_S = 30.0


class RequestView:
    """The client's copy of what a request's output stream reads of the engine's ``Request``."""

    __slots__ = ("request_id", "params", "num_prompt_tokens", "is_finished", "finish_reason", "stop_reason",
                 "arrival_time", "first_scheduled_time", "first_token_time", "finished_time",
                 "num_cached_tokens", "output_token_ids")

    def __init__(self, request_id: str, params: SamplingParams, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.params = params
        self.num_prompt_tokens = num_prompt_tokens
        self.is_finished = False
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.num_cached_tokens = 0
        self.output_token_ids: list[int] = []

    def update(self, record: tuple) -> None:
        """Take the engine's ``finish_record`` (timings, and the finish once there is one)."""
        (self.is_finished, reason, self.stop_reason, self.arrival_time, self.first_scheduled_time,
         self.first_token_time, self.finished_time, self.num_cached_tokens) = record
        self.finish_reason = FinishReason(reason) if reason is not None else None


class _Active:
    __slots__ = ("stream", "view")

    def __init__(self, stream: RequestStream, view: RequestView) -> None:
        self.stream = stream
        self.view = view


def _load_tokenizer(args: EngineArgs) -> Any:
    """The checkpoint's tokenizer, loaded here (the weights stay unread: the engine process loads them)."""
    return load_checkpoint(args.model or default_model_path(), args.load_format).tokenizer


class ProcessEngineClient(ClientBase):
    """``EngineClient``'s interface with the engine in a child process (started with ``spawn``); safe to use
    from any thread. ``emit`` callbacks run on this client's reader thread."""

    def __init__(self, args: EngineArgs) -> None:
        super().__init__()
        if args.tensor_parallel_size > 1:
            raise UnsupportedFeatureError("engine_process is not available with tensor parallelism (the engine "
                                          "stays in the server's process there); leave engine_process unset")
        self.args = args
        self.error: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self._closing: set[str] = set()   # stopped here, not yet released by the engine
        self._acks: dict[str, Future] = {}
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._last_stats: dict[str, float | int] = {}
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self.process = context.Process(target=run_engine, name="pocketllm-engine",
                                       args=(child, args, logging.getLogger().getEffectiveLevel()))
        self.process.start()
        child.close()
        try:
            info = self._start()
        except BaseException:
            self._stop_process(direct=True)
            raise
        self.caps: EngineCaps = info["caps"]
        self._model_path: str = info["model_path"]
        self._generation_config: dict[str, Any] = info["generation_config"]
        self._model_info: ModelInfo = info["model_info"]
        self.builder = RequestBuilder(self.tokenizer, info["max_model_len"], self.caps.structured_outputs,
                                      self.caps.details.get("architecture"))
        self._reader = threading.Thread(target=self._read, name="pocketllm-engine-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="pocketllm-engine-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # --- start and stop ---------------------------------------------------------------------------
    def _start(self) -> dict[str, Any]:
        """Load the tokenizer while the engine process loads the model; the engine's ``ready`` info."""
        tokenizer_error = None
        try:
            self.tokenizer = _load_tokenizer(self.args)
        except Exception as exc:   # the engine process reports the same checkpoint's problem first
            tokenizer_error = exc
        info = self._wait_ready()
        if tokenizer_error is not None:
            raise tokenizer_error
        return info

    def _wait_ready(self) -> dict[str, Any]:
        while True:
            ready = wait([self._conn, self.process.sentinel])
            if self._conn in ready:
                try:
                    kind, value = self._conn.recv()[0]
                except (EOFError, OSError):
                    kind, value = "exited", None
                if kind == "ready":
                    return value
                if kind == "failed":
                    raise value
            self.process.join(5)
            raise EngineDeadError(f"the engine process exited while loading (exit code {self.process.exitcode})")

    def _stop_process(self, direct: bool = False) -> None:
        """Ask the engine process to stop (it cancels what runs), then make sure it has gone. ``direct``:
        write to the pipe here (the writer thread has not started)."""
        if self.process.is_alive():
            if direct:
                try:
                    self._conn.send([("shutdown",)])
                except OSError:
                    pass
            else:
                self._outgoing.put(("shutdown",))
            self.process.join(SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s; terminating it", SHUTDOWN_TIMEOUT_S)
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)

    def shutdown(self) -> None:
        """Stop the engine process (running requests end cancelled) and this client's threads."""
        if self._closed:
            return
        self._closed = True
        self._stop_process()
        self._outgoing.put(None)
        self._reader.join(10)
        self._writer.join(10)
        self._conn.close()

    # --- the pipe ---------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        self._outgoing.put(message)

    def _write(self) -> None:
        """Send queued messages, all that are waiting in one batch (never blocking a caller on the pipe)."""
        while True:
            item = self._outgoing.get()
            batch, stop = [], item is None
            while item is not None:
                batch.append(item)
                try:
                    item = self._outgoing.get_nowait()
                except queue.Empty:
                    break
                stop = item is None
            if batch:
                try:
                    self._conn.send(batch)
                except OSError:
                    return   # the engine process has gone; the reader reports it
            if stop:
                return

    def _read(self) -> None:
        while True:
            try:
                messages = self._conn.recv()
            except (EOFError, OSError):
                break
            for message in messages:
                try:
                    self._dispatch(message)
                except Exception:
                    logger.exception("handling the engine's message %r failed", message[0])
        self.process.join(5)
        if self._closed:
            self._die(EngineDeadError("the engine has been shut down"), report=False)
        else:
            logger.error("the engine process exited unexpectedly (exit code %s)", self.process.exitcode)
            self._die(EngineDeadError(f"the engine process exited unexpectedly (exit code "
                                      f"{self.process.exitcode})"))

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "out":
            self._on_output(*message[1:])
        elif kind == "ack":
            _, request_id, error = message
            future = self._acks.pop(request_id, None)
            if error is not None:
                with self._lock:
                    self._active.pop(request_id, None)
            if future is not None and not future.done():
                future.set_result(None) if error is None else future.set_exception(error)
        elif kind == "err":
            _, request_id, error = message
            with self._lock:
                entry = self._active.pop(request_id, None)
                self._closing.discard(request_id)
            if entry is not None:
                entry.stream.on_error(error)
        elif kind == "reply":
            _, call_id, ok, value = message
            future = self._calls.pop(call_id, None)
            if future is not None and not future.done():
                future.set_result(value) if ok else future.set_exception(value)
        elif kind == "dead":
            logger.error("%s", message[1])
            self._die(EngineDeadError(message[1]))

    def _on_output(self, request_id: str, sampled: tuple | None, last: bool, record: tuple | None) -> None:
        """One engine output of a request: detokenise, match stop strings, hand events to the caller."""
        entry = self._active.get(request_id)
        if entry is None:   # stopped here already: wait for the engine to release the id
            if last and record is not None and record[0]:
                with self._lock:
                    self._closing.discard(request_id)
            return
        view = entry.view
        if record is not None:
            view.update(record)
        token = None if sampled is None else SampledToken(*sampled)
        try:
            stopped = entry.stream.on_output(view, token, last)
        except Exception as exc:
            logger.exception("output handler of request %s failed; cancelling it", request_id)
            self._end(request_id, view, last)
            entry.stream.on_error(exc)
            return
        if stopped or (view.is_finished and last):
            self._end(request_id, view, last)

    def _end(self, request_id: str, view: RequestView, last: bool) -> None:
        """Forget a request whose final output went out; cancel it in the engine if it still runs there."""
        with self._lock:
            self._active.pop(request_id, None)
            if not (view.is_finished and last):
                self._closing.add(request_id)
        if not view.is_finished:
            self._send(("abort", request_id))

    def _die(self, error: BaseException, report: bool = True) -> None:
        """Fail every request and pending call: the engine will not answer them."""
        with self._lock:
            if report and self.error is None:
                self.error = error
            active, self._active = self._active, {}
            self._closing.clear()
            acks, self._acks = self._acks, {}
            calls, self._calls = self._calls, {}
        for request_id, entry in active.items():
            try:
                entry.stream.on_error(error)
            except Exception:
                logger.exception("error handler of request %s failed", request_id)
        for future in [*acks.values(), *calls.values()]:
            if not future.done():
                future.set_exception(error)

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine cannot serve: {self.error}") from self.error
        if self._closed:
            raise EngineDeadError("the engine has been shut down")

    def _call(self, name: str, argument: Any = None) -> Future:
        future: Future = Future()
        with self._lock:
            self._check_alive()
            call_id = next(self._call_ids)
            self._calls[call_id] = future
        self._send(("call", call_id, name, argument))
        return future

    # --- EngineClient's interface -----------------------------------------------------------------
    def engine_caps(self) -> EngineCaps:
        return self.caps

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
               emit: Callable[[object], None], stream: bool, chat: ChatOutputSpec | None = None) -> Future:
        """As ``EngineClient.submit``; ``emit`` runs on this client's reader thread."""
        sink = self.request_stream(prompt_ids, params, request_id, emit, stream, chat)
        future: Future = Future()
        with self._lock:
            self._check_alive()
            if request_id in self._active or request_id in self._closing:
                raise InvalidRequestError(f"request id {request_id!r} is already active", param="request_id")
            self._active[request_id] = _Active(sink, RequestView(request_id, params, len(prompt_ids)))
            self._acks[request_id] = future
        self._send(("add", request_id, list(prompt_ids), params))
        return future

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id not in self._active or self.error is not None or self._closed:
                return False
        self._send(("abort", request_id))
        return True

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def stats(self) -> dict[str, float | int]:
        """The engine's counters (the last ones read once the engine process has gone)."""
        try:
            self._last_stats = self._call("stats").result(STATS_TIMEOUT_S)
        except Exception:
            if self.error is None and not self._closed:
                raise
        return dict(self._last_stats)

    def set_prefill_token_budget(self, tokens: int) -> Future:
        """Future of setting the most prompt tokens one request prefills per step (0: whole prompts)."""
        check_prefill_budget(tokens)
        return self._call("prefill_budget", tokens)

    @property
    def model_path(self) -> str:
        return self._model_path

    @property
    def generation_config(self) -> dict[str, Any]:
        return dict(self._generation_config)

    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    def export_prefix(self, token_ids: Sequence[int], first_token: int = 0) -> Future:
        """As ``EngineClient.export_prefix`` (the snapshot crosses the pipe pickled)."""
        result: Future = Future()
        call = self._call("export_prefix", ([int(t) for t in token_ids], first_token))
        call.add_done_callback(lambda f: result.set_exception(f.exception()) if f.exception() is not None
                               else result.set_result(pickle.loads(f.result())))
        return result

    def import_prefix(self, snapshot: KVSnapshot) -> Future:
        """As ``EngineClient.import_prefix``."""
        if not isinstance(snapshot, KVSnapshot):
            raise InvalidRequestError("import_prefix takes a KVSnapshot (see export_prefix)", param="snapshot")
        return self._call("import_prefix", pickle.dumps(snapshot))
