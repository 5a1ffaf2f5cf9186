"""The engine thread: takes commands between steps, runs steps while there is work, hands outputs to sinks."""

from __future__ import annotations

import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass

from pocketllm.engine import kv_snapshot
from pocketllm.engine.commands import (
    Abort,
    AddRequest,
    Command,
    ExportPrefix,
    ImportPrefix,
    OutputSink,
    SetPrefillBudget,
    Shutdown,
)
from pocketllm.engine.engine_core import EngineCore, StepOutput
from pocketllm.engine.request import FinishReason, Request
from pocketllm.errors import EngineDeadError, InvalidRequestError
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken

__all__ = ["EngineLoop", "OutputSink"]

logger = logging.getLogger("pocketllm.engine")

# Test hook: the engine thread sleeps this many milliseconds before every step, so that a test suite run with
# it set shows which tests assume the engine to be fast (``make test-slow``). Read once, when a loop is built.
STEP_DELAY_VAR = "POCKETLLM_TEST_STEP_DELAY_MS"


def step_delay_seconds(environ: Mapping[str, str] = os.environ) -> float:
    """The delay ``POCKETLLM_TEST_STEP_DELAY_MS`` asks for, in seconds (0 when unset or empty)."""
    raw = environ.get(STEP_DELAY_VAR, "").strip()
    if not raw:
        return 0.0
    try:
        milliseconds = float(raw)
    except ValueError:
        milliseconds = math.nan
    if not (math.isfinite(milliseconds) and milliseconds >= 0):
        raise ValueError(f"{STEP_DELAY_VAR}={raw!r}: expected a number of milliseconds >= 0")
    return milliseconds / 1000.0


@dataclass(frozen=True)
class _Queued:
    """A command on the queue with the future its result goes to (None: nobody waits for it)."""

    command: Command
    future: Future | None


class EngineLoop:
    """Runs ``EngineCore.step`` on a daemon thread. All engine state is touched only on that thread.

    Other threads talk to it through commands (``pocketllm.engine.commands``) that it runs between steps.
    The core is built on that thread too (``build``), so that loading, compiling and every step run their torch
    work on one thread. On CPU this matters for speed: each thread that runs a parallel torch op gets its own
    OpenMP worker team, and with more OpenMP threads than cores the runtime shortens its spin-waiting, so
    every later parallel op waits for a sleeping worker to wake. Measured on the 2-core development machine:
    a 70,000-element add took 11.7 µs on a thread that alone ran parallel ops, 19-35 µs once another thread
    had run one.
    """

    def __init__(self, build: Callable[[], EngineCore]) -> None:
        """Start the engine thread and wait until it has built the core (an error building it is raised
        here, and the thread has ended)."""
        self.step_delay = step_delay_seconds()   # the test hook (STEP_DELAY_VAR); 0 outside tests
        self.commands: queue.SimpleQueue[_Queued] = queue.SimpleQueue()
        self.sinks: dict[str, OutputSink] = {}
        self.active: set[str] = set()
        self.error: BaseException | None = None
        # Called on the engine thread after each batch of outputs (a step's, a command batch's, a crash's), so
        # that a sink which only records outputs can hand them on together (the engine process's outbox).
        self.after_outputs: Callable[[], None] | None = None
        self._stopping = False
        # Held while a caller queues a command and while a crash fails the queued ones: a command is either
        # queued before the crash (and failed by it) or refused afterwards, never left waiting.
        self._queue_lock = threading.Lock()
        built: Future = Future()
        self.thread = threading.Thread(target=self._run, args=(build, built), name="pocketllm-engine",
                                       daemon=True)
        self.thread.start()
        self.core: EngineCore = built.result()

    # --- called from any thread -------------------------------------------------------------------
    def send(self, command: Command) -> Future:
        """Queue ``command`` for the engine thread; its result (or error) comes back through the future."""
        future: Future = Future()
        with self._queue_lock:
            self._check_alive()
            self.commands.put(_Queued(command, future))
        return future

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
               sink: OutputSink) -> Future:
        """Queue a request; the future resolves once the engine accepted it (or raises its error)."""
        self._check_alive()
        if request_id in self.active:
            raise InvalidRequestError(f"request id {request_id!r} is already active", param="request_id")
        self.active.add(request_id)
        try:
            return self.send(AddRequest(request_id, prompt_token_ids, params, sink))
        except BaseException:
            self.active.discard(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Ask for a cancel at the next step boundary; True if the request is active now."""
        if request_id not in self.active or self.error is not None:
            return False
        self.commands.put(_Queued(Abort(request_id), None))
        return True

    def shutdown(self, timeout: float = 30.0) -> None:
        """Cancel what is still running and stop the thread."""
        if not self.thread.is_alive():
            return
        self.commands.put(_Queued(Shutdown(), None))
        self.thread.join(timeout)

    # --- engine thread ----------------------------------------------------------------------------
    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error!r}") from self.error
        if self._stopping or not self.thread.is_alive():
            raise EngineDeadError("the engine has been shut down")

    def _execute(self, command: Command) -> object:
        """Run one command on the engine thread; its result goes to the caller's future."""
        core = self.core
        match command:
            case AddRequest(request_id, prompt_token_ids, params, sink):
                core.add_request(request_id, prompt_token_ids, params)
                self.sinks[request_id] = sink
            case Abort(request_id):
                self._abort(request_id)
            case SetPrefillBudget(tokens):
                core.scheduler.set_prefill_chunk(tokens)
            case ExportPrefix(token_ids, model_path, first_token):
                return kv_snapshot.export_prefix(core, token_ids, model_path, first_token)
            case ImportPrefix(snapshot, model_path):
                return kv_snapshot.import_prefix(core, snapshot, model_path)
            case Shutdown():
                for request_id in list(self.sinks):
                    self._abort(request_id)
            case _:
                raise TypeError(f"not an engine command: {command!r}")
        return None

    def _fail(self, item: _Queued, exc: BaseException) -> None:
        if isinstance(item.command, AddRequest):
            self.active.discard(item.command.request_id)
        if item.future is not None:
            item.future.set_exception(exc)

    def _abort(self, request_id: str) -> None:
        request = self.core.abort(request_id)
        if request is not None:
            self._deliver(request, None)

    def _deliver(self, request: Request, token: SampledToken | None, last: bool = True,
                 num_outputs: int | None = None) -> None:
        """Hand one output to the request's sink. ``last``: no later output of the request follows in this step
        (a verify step gives several); ``num_outputs``: its output tokens up to this one, so that a stop string
        the sink finds here drops the ones after it."""
        sink = self.sinks.get(request.request_id)
        if sink is None:
            return
        try:
            end_now = sink.on_output(request, token, last)
        except Exception:
            logger.exception("output handler of request %s failed; cancelling it", request.request_id)
            end_now = not request.is_finished
            if end_now:
                self.core.finish(request, FinishReason.CANCELLED)
            self._release(request.request_id)
            return
        if end_now and not request.is_finished:
            if num_outputs is not None:
                del request.output_token_ids[num_outputs:]
            self.core.finish(request, FinishReason.STOP)
        if request.is_finished and (last or end_now):
            self._release(request.request_id)

    def _release(self, request_id: str) -> None:
        self.sinks.pop(request_id, None)
        self.active.discard(request_id)

    def _run_pipelined(self) -> None:
        """Keep one step queued on the device: launch step N+1 (scheduled with step N's tokens still pending
        on the device), then read step N back and deliver its outputs while N+1 runs.

        Step N is read back before anything else when commands are queued (submit, abort and shutdown see every
        launched step completed), when nothing more is scheduled, or when the next step's sampling needs step
        N's tokens on the host (grammars, penalties). A request ended by its sink during the overlap (a stop
        string) was already part of the launched step: that step's token for it is dropped by
        ``EngineCore.complete``.
        """
        previous = None
        while True:
            if previous is not None and (not self.commands.empty() or not self.core.has_work()
                                         or self.core.needs_sync()):
                self._deliver_all(self.core.complete(previous))
                previous = None
            if not self._drain(block=previous is None and not self.core.has_work()):
                break
            if self.step_delay:
                time.sleep(self.step_delay)
            pending = self.core.launch()
            if previous is not None:
                self._deliver_all(self.core.complete(previous))
            previous = pending
        if previous is not None:
            self._deliver_all(self.core.complete(previous))

    def _deliver_all(self, outputs: list[StepOutput]) -> None:
        for output in outputs:
            self._deliver(output.request, output.token, output.last, output.num_outputs)
        self._outputs_done()

    def _outputs_done(self) -> None:
        if self.after_outputs is not None:
            self.after_outputs()

    def _fail_queued(self, message: str) -> None:
        """Fail the futures of the commands still queued (after a crash or a shutdown they will never run)."""
        while True:
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return
            self._fail(item, EngineDeadError(message))

    def _drain(self, block: bool) -> bool:
        """Run queued commands; False once asked to stop."""
        try:
            item = self.commands.get(block=block)
        except queue.Empty:
            return True
        while True:
            try:
                result = self._execute(item.command)
            except BaseException as exc:  # handed to the caller through the future
                if item.future is None:
                    raise   # nobody waits for it (an abort): the engine's state is in doubt
                self._fail(item, exc)
            else:
                if item.future is not None:
                    item.future.set_result(result)
            if isinstance(item.command, Shutdown):
                self._outputs_done()
                return False
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                self._outputs_done()
                return True

    def _run(self, build: Callable[[], EngineCore], built: Future) -> None:
        try:
            self.core = build()
        except BaseException as exc:  # handed to the constructor's caller
            self._stopping = True
            built.set_exception(exc)
            return
        built.set_result(self.core)
        try:
            if getattr(self.core, "pipelined", False):
                self._run_pipelined()
                return
            while self._drain(block=not self.core.has_work()):
                if self.step_delay:
                    time.sleep(self.step_delay)
                self._deliver_all(self.core.step())
        except BaseException as exc:
            logger.exception("engine loop crashed")
            with self._queue_lock:
                self.error = exc
                self._fail_queued(f"the engine stopped after an error: {exc!r}")
            for request_id, sink in list(self.sinks.items()):
                try:
                    sink.on_error(exc)
                except Exception:
                    logger.exception("error handler of request %s failed", request_id)
                self._release(request_id)
        finally:
            with self._queue_lock:
                self._stopping = True
                self._fail_queued("the engine has been shut down")
            try:
                self._outputs_done()
            except Exception:
                logger.exception("handing on the last outputs failed")
