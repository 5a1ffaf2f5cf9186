"""``pocketllm bench startup``: time to first token of ``pocketllm run`` from a cold process.

Each run starts a new ``python -m pocketllm run PROMPT --max-tokens 1 --temperature 0`` and measures, from the
moment the process is started, when the first byte of the answer reaches its stdout (the time to first token: the
imports, the checkpoint read, the weight conversion, the prompt's prefill and the first sampled token) and when the
process has exited. The first run also converts the GGUF tokenizer into the user's cache when it is not there yet
(``--fresh-tokenizer-cache`` measures that case every time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from pocketllm.bench import common


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", "-m", default=None, help="Checkpoint (default: the default model).")
    parser.add_argument("--prompt", default="Hello", help="The prompt (default: %(default)s).")
    parser.add_argument("--runs", type=int, default=5, help="Cold processes to start (default: 5).")
    parser.add_argument("--fresh-tokenizer-cache", action="store_true",
                        help="Give every run an empty cache directory (the built kernels are linked in), so each "
                             "one converts the GGUF tokenizer as a first run does.")


def _one(command: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the first byte of stdout, seconds to exit) of one process."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout is not None
    first = process.stdout.read(1)
    ttft = time.perf_counter() - start
    _, err = process.communicate()
    total = time.perf_counter() - start
    if process.returncode != 0 or not first:
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise SystemExit(f"bench startup: the run failed (exit {process.returncode}): {tail[0]}")
    return ttft, total


def _fresh_cache_env(root: str) -> dict[str, str]:
    """An environment whose cache directory is empty but for a link to the built CPU kernels."""
    from pocketllm.cache_dir import cache_root

    os.makedirs(root, exist_ok=True)
    kernels = cache_root() / "cpu_kernels"
    if kernels.is_dir() and not os.path.exists(os.path.join(root, "cpu_kernels")):
        os.symlink(kernels, os.path.join(root, "cpu_kernels"))
    return {**os.environ, "POCKETLLM_CACHE_DIR": root}


def run(args: argparse.Namespace) -> None:
    command = [sys.executable, "-m", "pocketllm", "run", args.prompt, "--max-tokens", "1", "--temperature", "0"]
    if args.model:
        command += ["--model", args.model]
    ttfts, totals = [], []
    with tempfile.TemporaryDirectory(prefix="pocketllm-startup-") as scratch:
        for index in range(args.runs):
            env = (_fresh_cache_env(os.path.join(scratch, str(index))) if args.fresh_tokenizer_cache
                   else dict(os.environ))
            ttft, total = _one(command, env)
            ttfts.append(ttft)
            totals.append(total)
            print(f"run {index + 1}: first token {ttft:.2f} s, exit {total:.2f} s", file=sys.stderr)
    result: dict[str, Any] = {
        "benchmark": "startup", "hardware": common.hardware(), "command": " ".join(command[1:]),
        "fresh_tokenizer_cache": args.fresh_tokenizer_cache, "runs": args.runs,
        "ttft_s": {"median": statistics.median(ttfts), "min": min(ttfts), "max": max(ttfts), "all": ttfts},
        "exit_s": {"median": statistics.median(totals), "min": min(totals), "max": max(totals)},
        "load_average": common.load_average(),
    }
    print(f"pocketllm run, cold process: first token {result['ttft_s']['median']:.2f} s median "
          f"(min {min(ttfts):.2f}, max {max(ttfts):.2f}, {args.runs} runs), exit {result['exit_s']['median']:.2f} s "
          f"(load average {result['load_average']})")
    common.write_json(args.output_json, result)
    common.bar_plot(common.plot_path(args, args.output_json), "pocketllm run from a cold process",
                    {"first token": result["ttft_s"]["median"], "exit": result["exit_s"]["median"]}, "seconds",
                    note=f"median of {args.runs} runs")
