"""Host bookkeeping of the throughput workload's steps, without a model or a GPU: scheduling, the host batch
and the prefix-cache registration of each step, for 256 requests of 100–1024 prompt tokens.

    python scripts/host_prompt_steps.py [STEP_TOKENS]

Separates what the engine thread spends around a step (Python over requests and tokens) from what launching
the step's kernels costs, which needs the GPU machine (``scripts/profile_throughput.py --host-only``).
"""

from __future__ import annotations

import random
import sys
import time

from pocketllm.engine.block_manager import BlockManager
from pocketllm.engine.request import Request
from pocketllm.engine.scheduler import Scheduler, SchedulerLimits
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.host_batch import gather_host_batch


def main() -> None:
    step_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    rng = random.Random(0)
    blocks = BlockManager(60_000, 16, True)
    scheduler = Scheduler(SchedulerLimits(256, step_tokens, 4096), blocks, step_tokens)
    params = SamplingParams(max_tokens=500, temperature=0.6, ignore_eos=True)
    for i in range(256):
        prompt = [rng.randrange(151_936) for _ in range(rng.randint(100, 1024))]
        scheduler.add(Request(f"r{i}", prompt, params, frozenset()))
    print(f"{'step':>4s} {'chunks':>6s} {'tokens':>6s} {'schedule':>9s} {'host batch':>10s} {'cache blocks':>12s}  ms")
    for step in range(20):
        start = time.perf_counter()
        chunks = scheduler.schedule()
        scheduled = time.perf_counter()
        gather_host_batch(chunks, blocks.block_size)
        gathered = time.perf_counter()
        for chunk in chunks:   # what the engine does once a step's tokens are back (a token per sampling chunk)
            chunk.request.num_computed_tokens = chunk.end
            if chunk.samples:
                chunk.request.output_token_ids.append(1)
        advanced = time.perf_counter()
        for chunk in chunks:
            blocks.cache_full_blocks(chunk.request)
        done = time.perf_counter()
        tokens = sum(c.num_tokens for c in chunks)
        print(f"{step:4d} {len(chunks):6d} {tokens:6d} {1e3 * (scheduled - start):9.2f} "
              f"{1e3 * (gathered - scheduled):10.2f} {1e3 * (done - advanced):12.2f}")


if __name__ == "__main__":
    main()
