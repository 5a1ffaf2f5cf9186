"""``pocketllm bench throughput``: offline generation of a batch of random requests, all submitted at once.

The default shape is the nano-vllm benchmark: 256 requests, prompt and output lengths uniform in
[100, 1024], random token ids, temperature 0.6, EOS ignored. ``--peer hf`` runs the same requests through
HF transformers' continuous batching in the same process and prints the ratio; ``--peer llama.cpp`` runs them
through llama.cpp on the same GGUF, one request after another (``bench/llamacpp_peer.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

from pocketllm.bench import common
from pocketllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=256, help="Requests in the batch (default: 256).")
    parser.add_argument("--min-len", type=int, default=100, help="Shortest prompt and output (default: 100).")
    parser.add_argument("--max-len", type=int, default=1024, help="Longest prompt and output (default: 1024).")
    for side in ("input", "output"):
        parser.add_argument(f"--min-{side}-len", type=int, default=None, help=f"Shortest {side} (default: --min-len).")
        parser.add_argument(f"--max-{side}-len", type=int, default=None, help=f"Longest {side} (default: --max-len).")
    parser.add_argument("--temperature", type=float, default=0.6, help="Sampling temperature (default: 0.6).")
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the workload's lengths and token ids.")
    parser.add_argument("--warmup-requests", type=int, default=8,
                        help="Short requests run first to compile kernels (default: 8; 0 = none).")
    parser.add_argument("--peer-num-requests", type=int, default=None,
                        help="Run the peer on the first N requests only (default: all).")


def ranges(args: argparse.Namespace) -> tuple[tuple[int, int], tuple[int, int]]:
    inp = (args.min_input_len or args.min_len, args.max_input_len or args.max_len)
    out = (args.min_output_len or args.min_len, args.max_output_len or args.max_len)
    for lo, hi in (inp, out):
        if not 1 <= lo <= hi:
            raise SystemExit(f"pocketllm bench: length range [{lo}, {hi}] is empty or not positive")
    return inp, out


async def _generate(llm, workload: common.Workload, temperature: float) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = await asyncio.gather(*(
        llm.generate([prompt], SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True))
        for prompt, n in zip(workload.prompts, workload.output_lens)))
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(out[0].token_ids) for out in outputs)


def run_pocketllm(engine_args, workload_fn, temperature: float, warmup: int) -> dict[str, Any]:
    from pocketllm.api import AsyncLLM

    async def main() -> dict[str, Any]:
        started = time.perf_counter()
        async with AsyncLLM(engine_args) as llm:
            load_s = time.perf_counter() - started
            workload = workload_fn(common.engine_vocab_size(llm))
            if warmup:
                short = common.Workload([p[:32] for p in workload.prompts[:warmup]], [8] * min(warmup, len(
                    workload.prompts)))
                await _generate(llm, short, temperature)
            elapsed, generated = await _generate(llm, workload, temperature)
            stats = llm.stats()
            caps = llm.engine_caps()
        return {
            "elapsed_s": elapsed, "load_s": load_s, "num_requests": len(workload.prompts),
            "prompt_tokens": workload.num_prompt_tokens, "output_tokens": generated,
            "requests_per_s": len(workload.prompts) / elapsed, "output_tokens_per_s": generated / elapsed,
            "total_tokens_per_s": (generated + workload.num_prompt_tokens) / elapsed,
            "preemptions": stats.get("num_preemptions"), "steps": stats.get("num_steps"),
            "engine": dict(caps.details), "workload": workload,
        }

    return asyncio.run(main())


def run_hf(engine_args, workload: common.Workload, temperature: float) -> dict[str, Any]:
    """HF transformers continuous batching (``generate_batch``'s manager, one max_new_tokens per request)."""
    from transformers import GenerationConfig

    from pocketllm.runner.model_runner import resolve_device, resolve_dtype

    device = resolve_device(engine_args.device)
    dtype = resolve_dtype(engine_args.dtype, device)
    model = common.hf_peer_model(engine_args.model, engine_args.load_format, dtype, device)
    config = GenerationConfig(do_sample=temperature > 0, temperature=temperature if temperature > 0 else None,
                              max_new_tokens=max(workload.output_lens), eos_token_id=-1, pad_token_id=0,
                              top_k=None, top_p=None)
    common.sync(device)
    start = time.perf_counter()
    generated = 0
    mode = "manager.add_request"
    try:
        with model.continuous_batching_context_manager(generation_config=config, block=True) as manager:
            ids = [manager.add_request(p, max_new_tokens=n) for p, n in zip(workload.prompts, workload.output_lens)]
            pending = set(ids)
            while pending:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers' continuous batching thread stopped")
                    continue
                if result.is_finished() and result.request_id in pending:
                    pending.discard(result.request_id)
                    generated += len(result.generated_tokens)
    except (AttributeError, TypeError) as exc:  # another transformers version: the plain batch API
        mode = f"generate_batch (per-request lengths unavailable: {exc})"
        start = time.perf_counter()
        results = model.generate_batch(inputs=workload.prompts, generation_config=config)
        generated = sum(len(r.generated_tokens) for r in results.values())
    common.sync(device)
    elapsed = time.perf_counter() - start
    return {"elapsed_s": elapsed, "num_requests": len(workload.prompts), "output_tokens": generated,
            "output_tokens_per_s": generated / elapsed, "mode": mode}


def run(args: argparse.Namespace, engine_args) -> dict[str, Any]:
    input_range, output_range = ranges(args)
    if engine_args.max_model_len is None:
        engine_args = engine_args.replace(max_model_len=input_range[1] + output_range[1])

    def workload_fn(vocab: int) -> common.Workload:
        return common.random_workload(args.num_requests, input_range, output_range, vocab, args.workload_seed)

    ours = run_pocketllm(engine_args, workload_fn, args.temperature, args.warmup_requests)
    workload = ours.pop("workload")
    result: dict[str, Any] = {
        "benchmark": "throughput", "date": time.strftime("%Y-%m-%d"), "hardware": common.hardware(),
        "engine_args": {k: v for k, v in vars(engine_args).items()},
        "workload": {"num_requests": args.num_requests, "input_len": list(input_range),
                     "output_len": list(output_range), "temperature": args.temperature, "seed": args.workload_seed,
                     "ignore_eos": True},
        "pocketllm": ours,
    }
    print(f"pocketllm: {ours['num_requests']} requests, {ours['prompt_tokens']} prompt + {ours['output_tokens']} "
          f"output tokens in {ours['elapsed_s']:.2f} s: {ours['output_tokens_per_s']:,.0f} output tok/s, "
          f"{ours['total_tokens_per_s']:,.0f} total tok/s, {ours['requests_per_s']:.2f} req/s")
    bars = {"pocketllm": ours["output_tokens_per_s"]}
    if args.peer is not None:
        subset = workload.head(args.peer_num_requests) if args.peer_num_requests else workload
        common.release_memory()
        if args.peer == "hf":
            peer, label = run_hf(engine_args, subset, args.temperature), "hf transformers"
        else:
            from pocketllm.bench import llamacpp_peer

            peer, label = llamacpp_peer.run_throughput(engine_args, subset, args.temperature), "llama.cpp serial"
        ratio = ours["output_tokens_per_s"] / peer["output_tokens_per_s"] if peer["output_tokens_per_s"] else None
        peer["ratio_pocketllm_over_peer"] = ratio
        result["peer"] = {args.peer: peer}
        bars[label] = peer["output_tokens_per_s"]
        detail = f"({peer['mode']})" if args.peer == "hf" else f"(load average {common.load_average()})"
        shown = "llama.cpp (serial)" if args.peer == "llama.cpp" else label
        print(f"{shown}: {peer['num_requests']} requests, {peer['output_tokens']} output tokens in "
              f"{peer['elapsed_s']:.2f} s: {peer['output_tokens_per_s']:,.1f} output tok/s {detail}; "
              f"pocketllm / {args.peer} = {ratio:.2f}x")
    result["plot"] = common.bar_plot(
        common.plot_path(args, args.output_json),
        f"throughput, {args.num_requests} requests, in {input_range} out {output_range}", bars, "output tokens/s",
        f"{result['hardware'].get('gpu', result['hardware']['cpu'])}; {engine_args.model or 'default model'}")
    common.write_json(args.output_json, result)
    return result
