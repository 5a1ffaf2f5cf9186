"""Decode-step time at a given batch and context, wall clock against kernel time (torch profiler).

    python scripts/profile_step.py PRESET BATCH CONTEXT [eager|graphs] [TEMPERATURE] [QUANTIZATION]

PROFILE_ROWS sets how many kernels the table lists (default 20); PROFILE_TRACE=FILE writes the profiled steps'
Chrome trace there (``scripts/step_timeline.py`` reads it).

Runs the engine core directly (no engine thread): prefills BATCH random prompts of CONTEXT tokens, then
times decode steps. Wall minus kernel time is the host time the step does not hide.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from pocketllm.config import EngineArgs
from pocketllm.engine.engine_core import EngineCore
from pocketllm.loaders.dummy import preset_config
from pocketllm.sampling_params import SamplingParams


def main() -> None:
    preset, batch, context = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    eager = len(sys.argv) > 4 and sys.argv[4] == "eager"
    temperature = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    quantization = sys.argv[6] if len(sys.argv) > 6 else None
    args = EngineArgs(model=preset, load_format="dummy", max_model_len=context + 128, max_num_seqs=batch,
                      max_num_batched_tokens=min(16384, max(2048, batch * context)), enforce_eager=eager,
                      quantization=quantization)
    config = preset_config(preset)
    core = EngineCore(args, config, None, frozenset())
    rng = random.Random(0)
    params = SamplingParams(max_tokens=120, temperature=temperature, ignore_eos=True)
    requests = [core.add_request(f"r{i}", [rng.randrange(config.vocab_size) for _ in range(context)], params)
                for i in range(batch)]
    while any(not r.output_token_ids for r in requests):
        core.step()
    for _ in range(5):
        core.step()
    torch.cuda.synchronize()
    steps = 40
    start = time.perf_counter()
    for _ in range(steps):
        core.step()
    wall = (time.perf_counter() - start) / steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            core.step()
        torch.cuda.synchronize()
    kernel = sum(e.self_device_time_total for e in prof.key_averages()) / 20 / 1e6
    print(f"{preset} batch {batch} context {context} {'eager' if eager else 'graphs'} T={temperature}: "
          f"{quantization or ''} step wall {wall * 1e3:.3f} ms, kernels {kernel * 1e3:.3f} ms, "
          f"host exposed {(wall - kernel) * 1e3:.3f} ms,"
          f" {batch / wall:,.0f} tok/s")
    if os.environ.get("PROFILE_TRACE"):
        prof.export_chrome_trace(os.environ["PROFILE_TRACE"])
    rows = int(os.environ.get("PROFILE_ROWS", "20"))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=50))


if __name__ == "__main__":
    main()
