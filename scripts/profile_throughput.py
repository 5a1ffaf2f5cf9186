"""How busy the GPU is during the offline throughput workload: wall time against the time some kernel ran,
where the idle time falls, and what the engine thread spends per step.

    python scripts/profile_throughput.py [PRESET] [NUM_REQUESTS] [--host-only]

Runs the `bench throughput` workload (inputs and outputs uniform in [100, 1024], temperature 0.6, EOS
ignored) through `AsyncLLM` under the torch profiler (CUDA activity only), then prints the wall time, the
union of kernel intervals (device busy), the idle remainder split by gap length, the engine thread's host
time per step (schedule + launch, read-back + advance and the wait for the device within it, delivery to
the caller) by batch size (steps with a prompt chunk, which run eagerly, on their own row), and the
kernels that took the most time. ``--host-only`` runs without the profiler (whose tracing slows the host),
for the engine thread's times alone.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import defaultdict
from contextlib import nullcontext

import triton
from torch.profiler import ProfilerActivity, profile

from pocketllm.api import AsyncLLM
from pocketllm.bench import common
from pocketllm.config import EngineArgs
from pocketllm.engine.engine_core import EngineCore
from pocketllm.engine.loop import EngineLoop
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampleResult

GAP_EDGES_US = (10, 50, 200, 1000, 10_000)


def spans_of(events) -> list[tuple[float, float]]:
    return sorted((e.time_range.start, e.time_range.end) for e in events)


def busy_and_gaps(spans: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Length of the union of the kernels' [start, end] intervals (s) and the gaps between them (µs)."""
    total, end, gaps = 0.0, None, []
    for start, stop in spans:
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6, gaps


def gap_table(gaps: list[float]) -> str:
    rows, lo = [], 0
    for hi in (*GAP_EDGES_US, float("inf")):
        inside = [g for g in gaps if lo <= g < hi]
        rows.append(f"  gaps {lo:>6}–{hi:<6} µs: {len(inside):7d}, {sum(inside) / 1e6:6.3f} s")
        lo = hi
    return "\n".join(rows)


class HostClock:
    """Wall time the engine thread spends in launch, complete and delivery, per step, keyed by batch size."""

    def __init__(self) -> None:
        self.by_batch: dict[int, list[list[float]]] = defaultdict(list)
        self.current: list[float] | None = None

    def install(self) -> None:
        clock = self
        launch, complete, deliver = EngineCore.launch, EngineCore.complete, EngineLoop._deliver_all
        to_host = SampleResult.to_host

        def timed_launch(core, *a, **k):
            t = time.perf_counter()
            pending = launch(core, *a, **k)
            if pending is not None:
                clock.current = [time.perf_counter() - t, 0.0, 0.0, 0.0]
                prefill = any(c.num_tokens > 1 for c in pending.chunks)
                clock.by_batch[-1 if prefill else len(pending.chunks)].append(clock.current)
            return pending

        def timed_complete(core, pending, *a, **k):
            t = time.perf_counter()
            out = complete(core, pending, *a, **k)
            if clock.current is not None:
                clock.current[1] += time.perf_counter() - t
            return out

        def timed_deliver(loop, outputs):
            t = time.perf_counter()
            deliver(loop, outputs)
            if clock.current is not None:
                clock.current[2] += time.perf_counter() - t

        def timed_to_host(result, *a, **k):
            t = time.perf_counter()
            out = to_host(result, *a, **k)
            if clock.current is not None:
                clock.current[3] += time.perf_counter() - t
            return out

        EngineCore.launch, EngineCore.complete, EngineLoop._deliver_all = timed_launch, timed_complete, timed_deliver
        SampleResult.to_host = timed_to_host

    def table(self) -> str:
        rows = ["  batch      steps  launch ms  complete ms  (of which waiting) deliver ms"]
        for lo, hi in ((1, 16), (17, 64), (65, 128), (129, 192), (193, 256), (257, 10**6), (-1, -1)):
            steps = [s for b, ss in self.by_batch.items() if lo <= b <= hi for s in ss]
            if steps:
                n = len(steps)
                label = "prefill   " if lo < 0 else f"{lo:>3}-{hi:<6}"
                rows.append(f"  {label} {n:6d} {sum(s[0] for s in steps) / n * 1e3:10.3f} "
                            f"{sum(s[1] for s in steps) / n * 1e3:12.3f} {sum(s[3] for s in steps) / n * 1e3:19.3f} "
                            f"{sum(s[2] for s in steps) / n * 1e3:11.3f}")
        return "\n".join(rows)


class CompileLog:
    """Triton kernels compiled while the workload runs (each one stalls the engine thread)."""

    def __init__(self) -> None:
        self.entries: list[tuple[float, str]] = []
        self.started = time.perf_counter()

    def install(self) -> None:
        def hook(*args, **kwargs) -> None:
            name = kwargs.get("repr") or str(kwargs.get("fn", args[:1]))
            self.entries.append((time.perf_counter() - self.started, name))

        try:
            triton.knobs.runtime.jit_post_compile_hook = hook
        except AttributeError:
            print("(this Triton has no compile hook)")

    def table(self) -> str:
        return "\n".join(f"  {t:7.2f} s  {name[:400]}" for t, name in self.entries) or "  none"


async def run(preset: str, num_requests: int, host_only: bool) -> None:
    args = EngineArgs(model=preset, load_format="dummy", max_num_seqs=256, max_num_batched_tokens=8192)
    clock = HostClock()
    async with AsyncLLM(args) as llm:
        workload = common.random_workload(num_requests, (100, 1024), (100, 1024), common.engine_vocab_size(llm), 0)

        async def generate(w: common.Workload) -> int:
            outs = await asyncio.gather(*(llm.generate([p], SamplingParams(max_tokens=n, temperature=0.6,
                                                                            ignore_eos=True))
                                          for p, n in zip(w.prompts, w.output_lens)))
            return sum(len(o[0].token_ids) for o in outs)

        await generate(common.Workload([p[:32] for p in workload.prompts[:4]], [8] * 4))
        clock.install()
        compiles = CompileLog()
        compiles.install()
        with nullcontext() if host_only else profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            generated = await generate(workload)
            wall = time.perf_counter() - start
    if host_only:
        print(f"{preset}, {num_requests} requests: {generated} output tokens in {wall:.2f} s "
              f"({generated / wall:,.0f} tok/s, no profiler)")
        print("engine thread per step (host time):")
        print(clock.table())
        return
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    spans = spans_of(kernels)
    busy, gaps = busy_and_gaps(spans)
    print(f"{preset}, {num_requests} requests: {generated} output tokens in {wall:.2f} s "
          f"({generated / wall:,.0f} tok/s under the profiler); device busy {busy:.2f} s ({busy / wall:.0%}), "
          f"idle {wall - busy:.2f} s; first to last kernel {(spans[-1][1] - spans[0][0]) / 1e6:.2f} s")
    print(gap_table(gaps))
    print("Triton compiles during the run (seconds from its start):")
    print(compiles.table())
    print("engine thread per step (host time):")
    print(clock.table())
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=16, max_name_column_width=50))


if __name__ == "__main__":
    positional = [a for a in sys.argv[1:] if not a.startswith("--")]
    asyncio.run(run(positional[0] if positional else "qwen3-0.6b", int(positional[1]) if len(positional) > 1
                    else 256, "--host-only" in sys.argv))
