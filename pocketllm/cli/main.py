"""The ``pocketllm`` command."""

from __future__ import annotations

import argparse
import logging
import sys

from pocketllm.cli.bench_command import add_bench_parser
from pocketllm.cli.generate_commands import add_chat_parser, add_run_parser
from pocketllm.cli.harness_commands import add_harness_parsers
from pocketllm.cli.serve_command import add_serve_parser
from pocketllm.errors import PocketLLMError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm", description="A small, fast LLM inference engine.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_run_parser(subparsers)
    add_chat_parser(subparsers)
    add_serve_parser(subparsers)
    add_bench_parser(subparsers)
    add_harness_parsers(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a supervisor re-runs for each rank
    verbose = getattr(args, "verbose", False)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("pocketllm").setLevel(logging.DEBUG if verbose else logging.WARNING)
    try:
        return args.handler(args)
    except PocketLLMError as exc:
        print(f"pocketllm: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
