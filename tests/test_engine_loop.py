"""The engine thread's loop: what happens to queued work when a step raises."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pocketllm.engine.commands import SetPrefillBudget
from pocketllm.engine.loop import EngineLoop
from pocketllm.errors import EngineDeadError


class _CrashingCore:
    """A core whose first step waits until the test has queued a command, then raises."""

    pipelined = False

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def has_work(self) -> bool:
        return True

    def step(self) -> list:
        self.entered.set()
        self.release.wait(10)
        raise RuntimeError("step failed")


def test_commands_queued_during_a_crashing_step_fail_instead_of_hanging() -> None:
    core = _CrashingCore()
    loop = EngineLoop(lambda: core)
    assert core.entered.wait(10)
    queued = loop.send(SetPrefillBudget(0))          # queued while the step runs; the step then raises
    core.release.set()
    with pytest.raises(EngineDeadError, match="step failed"):
        queued.result(timeout=10)
    loop.thread.join(10)
    with pytest.raises(EngineDeadError):    # and later calls are refused at once
        loop.send(SetPrefillBudget(0))


class _IdleCore:
    """A core with no work: the loop only runs commands."""

    pipelined = False

    def __init__(self) -> None:
        self.scheduler = SimpleNamespace(prefill_chunk=7, set_prefill_chunk=self._set)

    def _set(self, tokens: int) -> None:
        self.scheduler.prefill_chunk = tokens

    def has_work(self) -> bool:
        return False

    def step(self) -> list:
        return []

    def abort(self, request_id: str) -> None:
        return None


def test_typed_commands_run_on_the_engine_thread_and_unknown_ones_are_refused() -> None:
    core = _IdleCore()
    loop = EngineLoop(lambda: core)
    try:
        assert loop.send(SetPrefillBudget(0)).result(timeout=10) is None
        assert core.scheduler.prefill_chunk == 0
        with pytest.raises(TypeError, match="not an engine command"):
            loop.send(object()).result(timeout=10)
    finally:
        loop.shutdown()
    assert not loop.thread.is_alive()
    with pytest.raises(EngineDeadError):
        loop.send(SetPrefillBudget(1))
