"""The engine process: runs the backend's engine loop and talks to its client over one pipe.

Messages are lists of tuples, pickled by ``multiprocessing.connection``. From the client: ``("add", id,
prompt_ids, params)``, ``("abort", id)``, ``("call", call_id, name, argument)`` and ``("shutdown",)``. To the
client, in one list per engine step (every request's outputs of that step together): ``("out", id, token,
last, finish)``, ``("err", id, error)``, ``("ack", id, error)``, ``("reply", call_id, ok, value)`` and
``("dead", message)``; first of all ``("ready", info)`` or ``("failed", error)``.
"""

from __future__ import annotations

import gc
import logging
import pickle
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pocketllm.backends import create_backend
from pocketllm.config import EngineArgs
from pocketllm.engine.commands import ExportPrefix, ImportPrefix, SetPrefillBudget
from pocketllm.engine.request import Request
from pocketllm.errors import PocketLLMError
from pocketllm.step.sampled import SampledToken

logger = logging.getLogger("pocketllm.engine")


def portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a ``PocketLLMError`` that names it."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return PocketLLMError(f"{type(exc).__name__}: {exc}")
    return exc


def finish_record(request: Request) -> tuple | None:
    """What the client needs of a request once it has its first token or has finished (None before)."""
    if request.first_token_time is None and not request.is_finished:
        return None
    reason = request.finish_reason.value if request.finish_reason is not None else None
    return (request.is_finished, reason, request.stop_reason, request.arrival_time, request.first_scheduled_time,
            request.first_token_time, request.finished_time, request.num_cached_tokens)


class Outbox:
    """Messages for the client, sent together: ``flush`` runs after each batch of engine outputs."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.items: list[tuple] = []
        self.lock = threading.Lock()
        self.send_lock = threading.Lock()
        self.loop = None
        self.dead_sent = False

    def post(self, item: tuple) -> None:
        with self.lock:
            self.items.append(item)

    def answer(self, item: tuple) -> None:
        """Post a command's answer from its future's callback: the engine thread sends it after the commands
        it runs; another thread (the future was done before the callback was added) sends it now."""
        self.post(item)
        if self.loop is None or threading.current_thread() is not self.loop.thread:
            self.flush()

    def flush(self) -> None:
        """Send what was posted (in order); tell the client once when the engine loop has crashed."""
        with self.send_lock:
            error = self.loop.error if self.loop is not None else None
            with self.lock:
                items, self.items = self.items, []
                if error is not None and not self.dead_sent:
                    self.dead_sent = True
                    items.append(("dead", f"the engine stopped after an error: {error!r}"))
            if items:
                try:
                    self.conn.send(items)
                except OSError:   # the client has gone: nobody is left to tell
                    pass


class ForwardSink:
    """An engine-side output sink that only records a request's outputs for the client (which detokenises
    them and matches stop strings, cancelling the request when one matches)."""

    __slots__ = ("request_id", "outbox", "told")

    def __init__(self, request_id: str, outbox: Outbox) -> None:
        self.request_id = request_id
        self.outbox = outbox
        self.told = False   # whether the client has the request's timings (sent with its first token)

    def on_output(self, request: Request, token: SampledToken | None, last: bool = True) -> bool:
        record = None
        if not self.told or request.is_finished:
            record = finish_record(request)
            self.told = record is not None
        sampled = None if token is None else (token.token_id, token.logprob, token.top_ids, token.top_logprobs)
        self.outbox.post(("out", self.request_id, sampled, last, record))
        return False

    def on_error(self, error: BaseException) -> None:
        self.outbox.post(("err", self.request_id, portable(error)))


def _reply(outbox: Outbox, call_id: int, future: Future, encode: Callable[[Any], Any] | None = None) -> None:
    """Post a command's result when its future is done (on the engine thread: flushed after the commands)."""
    def done(f: Future) -> None:
        exc = f.exception()
        if exc is None:
            value = f.result()
            outbox.answer(("reply", call_id, True, encode(value) if encode is not None else value))
        else:
            outbox.answer(("reply", call_id, False, portable(exc)))

    future.add_done_callback(done)


def _ack(outbox: Outbox, request_id: str, future: Future) -> None:
    future.add_done_callback(lambda f: outbox.answer(("ack", request_id, None if f.exception() is None
                                                      else portable(f.exception()))))


def _handle(backend: Any, outbox: Outbox, message: tuple) -> bool:
    """Run one client message; False once asked to stop."""
    loop = backend.loop
    kind = message[0]
    if kind == "add":
        _, request_id, prompt_ids, params = message
        try:
            _ack(outbox, request_id, loop.submit(request_id, prompt_ids, params, ForwardSink(request_id, outbox)))
        except Exception as exc:   # refused at once (a duplicate id, a stopped engine)
            outbox.post(("ack", request_id, portable(exc)))
            outbox.flush()
    elif kind == "abort":
        loop.abort(message[1])
    elif kind == "call":
        _, call_id, name, argument = message
        try:
            if name == "stats":
                outbox.post(("reply", call_id, True, backend.core.stats()))
                outbox.flush()
            elif name == "prefill_budget":
                _reply(outbox, call_id, loop.send(SetPrefillBudget(argument)))
            elif name == "export_prefix":
                token_ids, first_token = argument
                _reply(outbox, call_id, loop.send(ExportPrefix(token_ids, backend.model_path, first_token)),
                       pickle.dumps)
            elif name == "import_prefix":
                _reply(outbox, call_id, loop.send(ImportPrefix(pickle.loads(argument), backend.model_path)))
            else:
                raise PocketLLMError(f"unknown engine call {name!r}")
        except Exception as exc:
            outbox.post(("reply", call_id, False, portable(exc)))
            outbox.flush()
    elif kind == "shutdown":
        return False
    return True


def ready_info(backend: Any) -> dict[str, Any]:
    """What the client learns once the engine has loaded: capabilities, limits, paths and model facts."""
    return {"caps": backend.caps, "max_model_len": backend.core.max_model_len, "model_path": backend.model_path,
            "generation_config": dict(backend.checkpoint.generation_config or {}),
            "model_info": backend.model_info()}


def freeze_startup_heap() -> None:
    """For a process that serves until it exits, once it has loaded: collect, then move every object alive now
    out of the garbage collector's view (``gc.freeze``). Each full collection would otherwise walk the hundreds of
    thousands of objects the imports and the model's set-up left (measured: about 290 ms a collection in the API
    process, a pause of every stream); only what serving allocates is walked from then on."""
    gc.collect()
    gc.freeze()


def run_engine(conn: Any, args: EngineArgs, log_level: int) -> None:
    """The engine process's entry point: build the backend, then serve the client until it says stop or its
    end of the pipe closes (the client's process exited)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # a Ctrl-C reaches the whole group: the client stops us
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    try:
        backend = create_backend(args)
    except BaseException as exc:   # handed to the client, which raises it
        conn.send([("failed", portable(exc))])
        conn.close()
        return
    outbox = Outbox(conn)
    outbox.loop = backend.loop
    backend.loop.after_outputs = outbox.flush
    freeze_startup_heap()
    try:
        conn.send([("ready", ready_info(backend))])
        running = True
        while running:
            try:
                messages = conn.recv()
            except (EOFError, OSError):
                break
            for message in messages:
                running = running and _handle(backend, outbox, message)
    finally:
        backend.shutdown()
        outbox.flush()
        conn.close()
