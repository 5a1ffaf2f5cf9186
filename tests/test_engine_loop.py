"""The engine thread's loop: what happens to queued work when a step raises, typed commands, the test-only
step delay."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pocketllm.engine import loop as loop_module
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


class _CountingCore:
    """A core with a few steps of work; each step (or launch) records how many sleeps the loop made before it."""

    def __init__(self, pipelined: bool, sleeps: list[float], steps: int = 3) -> None:
        self.pipelined = pipelined
        self.sleeps = sleeps
        self.left = steps
        self.sleeps_before_step: list[int] = []
        self.done = threading.Event()

    def has_work(self) -> bool:
        return self.left > 0

    def needs_sync(self) -> bool:
        return False

    def launch(self) -> object | None:
        if not self.left:
            return None
        self.sleeps_before_step.append(len(self.sleeps))
        self.left -= 1
        return object()

    def complete(self, pending: object) -> list:
        if not self.left:
            self.done.set()
        return []

    def step(self) -> list:
        return self.complete(self.launch())

    def abort(self, request_id: str) -> None:
        return None


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize(("raw", "delay"), [(None, 0.0), ("", 0.0), ("20", 0.02), ("0.5", 0.0005)])
def test_test_step_delay_sleeps_before_every_step(monkeypatch: pytest.MonkeyPatch, pipelined: bool,
                                                  raw: str | None, delay: float) -> None:
    """POCKETLLM_TEST_STEP_DELAY_MS, read when the loop is built, sleeps that long before each step (and
    never sleeps when unset)."""
    if raw is None:
        monkeypatch.delenv(loop_module.STEP_DELAY_VAR, raising=False)
    else:
        monkeypatch.setenv(loop_module.STEP_DELAY_VAR, raw)
    sleeps: list[float] = []
    monkeypatch.setattr(loop_module, "time", SimpleNamespace(sleep=sleeps.append))
    core = _CountingCore(pipelined, sleeps)
    loop = EngineLoop(lambda: core)
    try:
        assert core.done.wait(10)
    finally:
        loop.shutdown()
    assert loop.step_delay == delay
    if delay:
        assert sleeps == [delay] * 3 and core.sleeps_before_step == [1, 2, 3]
    else:
        assert sleeps == [] and core.sleeps_before_step == [0, 0, 0]


@pytest.mark.parametrize("raw", ["fast", "-1", "nan", "inf"])
def test_a_bad_test_step_delay_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    """A step delay that is not a finite number of milliseconds >= 0 stops the loop from being built."""
    monkeypatch.setenv(loop_module.STEP_DELAY_VAR, raw)
    with pytest.raises(ValueError, match=loop_module.STEP_DELAY_VAR):
        EngineLoop(_IdleCore)
