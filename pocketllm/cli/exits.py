"""How the ``pocketllm`` command ends: usage errors in one line, and Ctrl-C with status 130 and no traceback.

An interrupted command may leave the engine thread running (a model still loading, a step in native code);
letting the interpreter tear down around it can abort the process from that thread ("terminate called without
an active exception"). So the process's children get the SIGINT too (a kernel build's ninja: a terminal sends
it them anyway), the engine threads this command started are asked to stop (KeyboardInterrupt raised in them,
so their ``finally`` blocks run: the kernel build's lock file is released), waited for a few seconds, and the
process then leaves with ``os._exit`` after flushing its output.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Collection, Sequence
from typing import NoReturn

from pocketllm.harness.lifecycle import INTERRUPTED

ENGINE_THREAD = "pocketllm-engine"
STOP_WAIT_S = 5.0


def command_at(argv: Sequence[str]) -> int:
    """Where the command word is in ``argv``: the first argument that is not a flag (``len(argv)`` if none)."""
    return next((i for i, arg in enumerate(argv) if not arg.startswith("-")), len(argv))


class CliParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (the options are listed by ``--help``, not on every error)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but arguments no parser took are refused by the innermost command's parser (its name
        and ``--help`` in the message: ``pocketllm run``, not ``pocketllm``)."""
        argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(argv, namespace)
        if extra:
            # a flag before the command (``pocketllm --bogus run``) is this parser's to refuse
            before_command = set(argv[:command_at(argv)]) & set(extra)
            parser = self if before_command else self._command_parser(parsed)
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, CliParser):
                    return chosen._command_parser(parsed)
        return self


class UsageError(SystemExit):
    """A usage error found after parsing: status 2; its message (already printed) is its text."""

    def __init__(self, message: str) -> None:
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


def usage_error(command: str, message: str) -> NoReturn:
    """One line on stderr, then status 2."""
    print(f"pocketllm {command}: error: {message}", file=sys.stderr)
    raise UsageError(message)


def raise_on_ctrl_c() -> None:
    """Ctrl-C raises KeyboardInterrupt where the main thread is, as Python's own handler does, but through a
    handler of ours: ``asyncio.run`` (3.11+) then keeps it instead of putting in its own, which only cancels
    the main task when the loop next runs (not while a model loads on the loop's thread: minutes, maybe)."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    try:
        signal.signal(signal.SIGINT, interrupt)
    except ValueError:   # not the main thread
        pass


def engine_threads(ignore: Collection[int] = ()) -> list[threading.Thread]:
    """The engine threads running now (``pocketllm.engine.loop``), but those whose ids are in ``ignore``."""
    return [t for t in threading.enumerate() if t.name == ENGINE_THREAD and t.is_alive() and t.ident not in ignore]


def finish(status: int, before: Collection[int]) -> int:
    """``status`` to return from ``main``; or, after Ctrl-C or with an engine thread this command started still
    running (``before``: the engine threads there were already), leave the process now."""
    if status == INTERRUPTED or engine_threads(before):
        leave(status, before)
    return status


def _interrupt_children() -> None:
    """SIGINT to this process's children (a kernel build's ninja), as a terminal's Ctrl-C does to its whole
    foreground group: the engine thread waiting on one can then unwind (and release the build's lock) before
    the process leaves. Linux's /proc lists them; elsewhere nothing is sent."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children", encoding="ascii") as handle:
                children = [int(pid) for pid in handle.read().split()]
        except OSError:
            continue
        for pid in children:
            try:
                os.kill(pid, signal.SIGINT)
            except OSError:
                pass


def leave(status: int, before: Collection[int]) -> NoReturn:
    """Stop what this command started (see the module's docstring), say "interrupted" after Ctrl-C, and exit."""
    try:   # a second Ctrl-C while engine threads stop leaves at once
        signal.signal(signal.SIGINT, lambda *_: os._exit(status))
    except ValueError:   # not the main thread
        pass
    logging.disable(logging.CRITICAL)   # a thread unwinding has nothing more to say
    _interrupt_children()
    threads = engine_threads(before)
    for thread in threads:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt))
    deadline = time.monotonic() + STOP_WAIT_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if status == INTERRUPTED:
        print("\npocketllm: interrupted" if sys.stderr.isatty() else "pocketllm: interrupted", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
