"""Where a cold ``pocketllm run`` spends its time before the first token: a stage-by-stage breakdown.

Runs what ``pocketllm run --prompt ...`` runs (build the engine on the default model, stream a chat answer) in
this fresh process, with the stages timed by wrapping the functions that do them:

    python scripts/startup_time.py [--cpu-weight-format auto] [--prompt "..."]

Each line gives the stage's wall time and the process's CPU time in it (on a shared machine the wall time
includes waiting for a core). ``process start`` is read from the kernel, so the import of this script counts.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

_WALL0 = time.perf_counter()
_CPU0 = time.process_time()


def _since_process_start() -> float:
    """Seconds since this process started (Linux: /proc/self/stat), or since this module ran elsewhere."""
    try:
        with open("/proc/self/stat", encoding="ascii") as handle:
            start_ticks = int(handle.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as handle:
            uptime = float(handle.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _WALL0


_PROCESS_AT_IMPORT = _since_process_start()
STAGES: list[tuple[str, float, float]] = []


def _timed(label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            STAGES.append((label, time.perf_counter() - wall, time.process_time() - cpu))

    return wrapper


def _wrap(owner: Any, name: str, label: str) -> None:
    setattr(owner, name, _timed(label, getattr(owner, name)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="What is the capital of France?")
    parser.add_argument("--cpu-weight-format", default="auto")
    args = parser.parse_args()

    wall, cpu = time.perf_counter(), time.process_time()
    import torch  # noqa: F401  (timed apart: most of the imports)

    STAGES.append(("import torch", time.perf_counter() - wall, time.process_time() - cpu))
    wall, cpu = time.perf_counter(), time.process_time()
    from pocketllm import EngineArgs, SamplingParams
    from pocketllm.api import LLM
    from pocketllm.backends import torch_backend
    from pocketllm.kernels import cpu_native
    from pocketllm.layers import quantized_linear
    from pocketllm.loaders import checkpoint, gguf_loader
    from pocketllm.runner import cpu_decode, model_runner

    STAGES.append(("import pocketllm (after torch)", time.perf_counter() - wall, time.process_time() - cpu))

    _wrap(gguf_loader, "open_gguf", "GGUF metadata read")
    _wrap(gguf_loader, "build_config", "model config from GGUF")
    _wrap(checkpoint, "_gguf_tokenizer", "tokenizer from GGUF")
    _wrap(model_runner.ModelRunner, "__init__", "model built (empty weights)")
    _wrap(model_runner, "load_weights", "weights: dequantise + copy")
    _wrap(quantized_linear, "convert_model", "repack linear layers (cpu_weight_format)")
    _wrap(cpu_native, "available", "CPU kernels: load (or build)")
    _wrap(cpu_decode.CpuDecodeStep, "__init__", "CPU decode step set up")
    _wrap(model_runner.ModelRunner, "allocate_kv_cache", "KV cache allocated")
    _wrap(torch_backend, "EngineCore", "engine core total")

    started = time.perf_counter()
    with LLM(EngineArgs(cpu_weight_format=args.cpu_weight_format)) as llm:
        built = time.perf_counter()
        first = None
        for event in llm.chat_stream([{"role": "user", "content": args.prompt}],
                                     SamplingParams(max_tokens=16, temperature=0.0)):
            if first is None and event.text:
                first = time.perf_counter()
        fmt = llm.engine_caps().details.get("cpu_weight_format", args.cpu_weight_format)
    print(f"cpu_weight_format: {fmt}")
    print(f"{'stage':44s} {'wall s':>8s} {'cpu s':>8s}")
    print(f"{'interpreter start to this script':44s} {_PROCESS_AT_IMPORT:8.2f} {'':>8s}")
    totals: dict[str, list[float]] = {}
    for label, wall_s, cpu_s in STAGES:   # a stage run several times (a call per layer) is summed
        entry = totals.setdefault(label, [0.0, 0.0])
        entry[0] += wall_s
        entry[1] += cpu_s
    for label, (wall_s, cpu_s) in totals.items():
        print(f"{label:44s} {wall_s:8.2f} {cpu_s:8.2f}")
    print(f"{'LLM(...) total':44s} {built - started:8.2f}")
    print(f"{'first token after LLM(...)':44s} {(first or built) - built:8.2f}")
    total = _PROCESS_AT_IMPORT + (first or built) - _WALL0
    print(f"{'process start to first token':44s} {total:8.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
