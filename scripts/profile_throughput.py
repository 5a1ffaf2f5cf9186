"""How busy the GPU is during the offline throughput workload: wall time against the time some kernel ran.

    python scripts/profile_throughput.py [PRESET] [NUM_REQUESTS]

Runs the `bench throughput` workload (inputs and outputs uniform in [100, 1024], temperature 0.6, EOS
ignored) through `AsyncLLM` under the torch profiler (CUDA activity only), then prints the wall time, the
union of kernel intervals (device busy), the idle remainder (host time the pipeline did not hide) and the
kernels that took the most time.
"""

from __future__ import annotations

import asyncio
import sys
import time

from torch.profiler import ProfilerActivity, profile

from pocketllm.api import AsyncLLM
from pocketllm.bench import common
from pocketllm.config import EngineArgs
from pocketllm.sampling_params import SamplingParams


def busy_seconds(events) -> float:
    """Length of the union of the kernels' [start, end] intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, end = 0, None
    for start, stop in spans:
        if end is None or start > end:
            total += stop - start
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total / 1e6


async def run(preset: str, num_requests: int) -> None:
    args = EngineArgs(model=preset, load_format="dummy", max_num_seqs=256, max_num_batched_tokens=8192)
    async with AsyncLLM(args) as llm:
        workload = common.random_workload(num_requests, (100, 1024), (100, 1024), common.engine_vocab_size(llm), 0)

        async def generate(w: common.Workload) -> int:
            outs = await asyncio.gather(*(llm.generate([p], SamplingParams(max_tokens=n, temperature=0.6,
                                                                            ignore_eos=True))
                                          for p, n in zip(w.prompts, w.output_lens)))
            return sum(len(o[0].token_ids) for o in outs)

        await generate(common.Workload([p[:32] for p in workload.prompts[:4]], [8] * 4))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            generated = await generate(workload)
            wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = busy_seconds(kernels)
    print(f"{preset}, {num_requests} requests: {generated} output tokens in {wall:.2f} s "
          f"({generated / wall:,.0f} tok/s under the profiler); device busy {busy:.2f} s ({busy / wall:.0%}), "
          f"idle {wall - busy:.2f} s")
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    asyncio.run(run(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b", int(sys.argv[2]) if len(sys.argv) > 2
                    else 256))
