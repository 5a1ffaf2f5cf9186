"""The ``pocketllm`` command.

Importing this module and building the parser import nothing heavy (torch loads when a command needs it), so
that ``--help``, usage errors and a busy port answer at once, and Ctrl-C at any moment ends in one line.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from pocketllm.cli.bench_command import add_bench_parser
from pocketllm.cli.exits import CliParser, command_at, engine_threads, finish, raise_on_ctrl_c
from pocketllm.cli.generate_commands import add_chat_parser, add_run_parser
from pocketllm.cli.harness_commands import add_harness_parsers
from pocketllm.cli.serve_command import add_serve_parser
from pocketllm.errors import PocketLLMError
from pocketllm.harness.lifecycle import INTERRUPTED

logger = logging.getLogger("pocketllm.cli")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; the benchmarks' options (whose modules import torch) only when ``command`` is bench or None."""
    parser = CliParser(prog="pocketllm", description="A small, fast LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(subparsers)
    add_chat_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers, full=command in (None, "bench"))
    add_harness_parsers(subparsers)
    return parser


def _command(argv: list[str]) -> str:
    at = command_at(argv)
    return argv[at] if at < len(argv) else ""


def _run(argv: list[str]) -> int:
    args = build_parser(_command(argv)).parse_args(argv)
    args.argv = argv  # what a supervisor re-runs for each rank
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pocketllm").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        return args.handler(args)
    except PocketLLMError as exc:
        print(f"pocketllm: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception as exc:  # a bug or an unexpected failure: still one line (the traceback with --verbose)
        logger.debug("%s failed", args.command, exc_info=True)
        hint = "" if verbose or not hasattr(args, "verbose") else " (--verbose shows where)"
        print(f"pocketllm: error: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 1


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default: this process's arguments, and then the process is the command's own:
    after Ctrl-C, or with an engine thread still running, it leaves through ``exits.leave``)."""
    before = {t.ident for t in engine_threads()}
    if argv is None:
        raise_on_ctrl_c()
    try:
        status = _run(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:
        status = INTERRUPTED
    except BrokenPipeError:   # the reader of stdout went away (``pocketllm run … | head -1``)
        status = 1
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # what is still buffered goes nowhere
    return finish(status, before) if argv is None else status


if __name__ == "__main__":
    sys.exit(main())
