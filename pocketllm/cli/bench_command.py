"""``pocketllm bench``: throughput (offline batch), latency (batch 1), serve (HTTP load) and startup (cold
process) benchmarks."""

from __future__ import annotations

import argparse
import importlib
import logging
import os

from pocketllm.cli.engine_flags import add_engine_flags, engine_args_from
from pocketllm.cli.exits import usage_error
from pocketllm.cli.launched_ranks import launched_rank


def _common(parser: argparse.ArgumentParser, peer: bool) -> None:
    parser.add_argument("--output-json", default=None, help="Write the results as JSON to this file.")
    parser.add_argument("--plot", default=None, help="PNG plot path (default: the JSON path with .png; needs "
                                                     "matplotlib, the 'bench' extra).")
    parser.add_argument("--verbose", action="store_true", help="Log engine decisions at DEBUG.")
    if peer:
        parser.add_argument("--peer", choices=["hf", "llama.cpp"], default=None,
                            help="Also run HF transformers, or llama.cpp on the same GGUF (the 'llamacpp' extra), "
                                 "on the same workload and print the ratio.")


BENCHMARKS = (
    ("throughput", "Offline throughput of a batch of random requests (nano-vllm shape).", True),
    ("latency", "Batch-1 time to first token, decode tok/s and memory bandwidth.", True),
    ("serve", "HTTP load against a running 'pocketllm serve'.", False),
    ("startup", "Time to first token of 'pocketllm run' from a cold process.", False),
)


def add_bench_parser(subparsers, full: bool = True) -> None:
    """``full``: with every benchmark's options, which imports the benchmark modules (and torch); without,
    the command is only listed (for the parser of another command)."""
    parser = subparsers.add_parser("bench", help="Benchmarks: throughput, latency, serve, startup.")
    if not full:
        return
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    for name, help_text, engine in BENCHMARKS:
        module = importlib.import_module(f"pocketllm.bench.{name}")
        sub = commands.add_parser(name, help=help_text)
        module.add_arguments(sub)
        _common(sub, peer=engine)
        if engine:
            add_engine_flags(sub)
        sub.set_defaults(handler=bench_command, bench_module=module, bench_engine=engine)


def _check_outputs(args: argparse.Namespace) -> None:
    """``--output-json`` and ``--plot`` name files in writable folders: found before the run, not after it."""
    for flag, path in (("--output-json", args.output_json), ("--plot", args.plot)):
        if not path:
            continue
        folder = os.path.dirname(os.path.abspath(path))
        if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            usage_error(f"bench {args.bench_command}",
                        f"{flag} {path}: the folder {folder} does not exist or cannot be written")


def bench_command(args: argparse.Namespace) -> int:
    _check_outputs(args)
    if not args.verbose:
        logging.getLogger("pocketllm").setLevel(logging.INFO)
        logging.getLogger("pocketllm.scheduler").setLevel(logging.WARNING)
    if args.bench_engine:
        engine_args = engine_args_from(args)
        if (status := launched_rank(engine_args)) is not None:
            return status
        args.bench_module.run(args, engine_args)
    else:
        args.bench_module.run(args)
    return 0
