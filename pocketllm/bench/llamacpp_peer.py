"""llama.cpp as a bench peer (``--peer llama.cpp``, the ``llamacpp`` extra: ``llama-cpp-python``).

It runs the same GGUF file and the same token-id workload in the same process, after PocketLLM has released
its model, with as many threads as torch uses. Streams run one after another (serially): the plain
``Llama`` API decodes one sequence at a time.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pocketllm.bench import common

INSTALL_HINT = "pip install 'pocketllm[llamacpp]'"


def gguf_path(engine_args) -> str:
    """The GGUF file the engine ran (llama.cpp reads nothing else)."""
    from pocketllm.loaders.default_model import default_model_path

    path = engine_args.model or default_model_path()
    if engine_args.load_format == "dummy" or not path.lower().endswith(".gguf"):
        raise SystemExit(f"pocketllm bench: --peer llama.cpp needs a GGUF checkpoint; got {path!r}")
    return path


def load(engine_args, n_ctx: int) -> Any:
    """A ``llama_cpp.Llama`` over the engine's GGUF with torch's thread count."""
    path = gguf_path(engine_args)
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit(f"pocketllm bench: --peer llama.cpp needs llama-cpp-python ({INSTALL_HINT})") from None
    threads = torch.get_num_threads()
    return Llama(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                 n_threads_batch=threads, seed=0, verbose=False)


def _stream(llm, prompt: list[int], output_len: int, temperature: float) -> dict[str, float]:
    """One generation from a cleared cache: TTFT, decode tokens/s, tokens, total seconds."""
    llm.reset()
    start = time.perf_counter()
    first = last = None
    count = 0
    sampling = {"temp": temperature, "top_k": 1 if temperature == 0 else 0, "top_p": 1.0, "min_p": 0.0}
    for _ in llm.generate(prompt, reset=True, **sampling):
        now = time.perf_counter()
        count += 1
        first = first or now
        last = now
        if count >= output_len:
            break
    decode = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return {"ttft_s": first - start, "decode_tokens_per_s": decode, "tokens": count, "total_s": last - start}


def run_latency(engine_args, prompt: list[int], output_len: int, iters: int, warmup: int) -> dict[str, Any]:
    """Batch-1 greedy generation, timed like PocketLLM's (median of ``iters`` after ``warmup`` runs)."""
    import statistics

    llm = load(engine_args, len(prompt) + output_len + 8)
    for _ in range(warmup):
        _stream(llm, prompt, output_len, 0.0)
    runs = [_stream(llm, prompt, output_len, 0.0) for _ in range(iters)]
    llm.close()
    return {"ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
            "runs": runs, "threads": torch.get_num_threads(), "mode": "Llama.generate, greedy"}


def run_throughput(engine_args, workload: common.Workload, temperature: float) -> dict[str, Any]:
    """The workload's requests one after another (llama.cpp serial)."""
    n_ctx = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens)) + 8
    llm = load(engine_args, n_ctx)
    start = time.perf_counter()
    generated = sum(int(_stream(llm, p, n, temperature)["tokens"])
                    for p, n in zip(workload.prompts, workload.output_lens))
    elapsed = time.perf_counter() - start
    llm.close()
    return {"elapsed_s": elapsed, "num_requests": len(workload.prompts), "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed, "threads": torch.get_num_threads(),
            "mode": "Llama.generate, one request after another"}
