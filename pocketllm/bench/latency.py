"""``pocketllm bench latency``: one request at a time (batch 1).

Reports time to first token, decode tokens/s, the step time split into device-busy time and exposed host
time (CUDA: kernel time from the PyTorch profiler), and the achieved weight bandwidth (weight bytes × decode
tokens/s) against the memory bandwidth measured on the same device with a large copy. ``--peer hf`` times
HF transformers' ``generate`` on the same prompt and prints the ratio; ``--peer llama.cpp`` does the same with
llama.cpp on the same GGUF (``bench/llamacpp_peer.py``). With ``--speculative-config`` it compares decoding with
and without speculation over a prompt set instead (``bench/speculative.py``).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from pocketllm.bench import common
from pocketllm.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=128, help="Prompt tokens (default: 128).")
    parser.add_argument("--output-len", type=int, default=128, help="Generated tokens (default: 128).")
    parser.add_argument("--num-iters", type=int, default=3, help="Timed runs; the median is reported (default: 3).")
    parser.add_argument("--warmup-iters", type=int, default=1, help="Untimed runs first (default: 1).")
    parser.add_argument("--workload-seed", type=int, default=0, help="Seed of the prompt's random token ids.")
    parser.add_argument("--peak-bandwidth-gbs", type=float, default=None,
                        help="Memory bandwidth bound in GB/s (default: measured with a large device copy).")


def _one_run(llm, prompt: list[int], output_len: int) -> dict[str, float]:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    first = last = None
    count = 0
    for event in llm.generate_stream(prompt, params):
        now = time.perf_counter()
        if event.token_ids:
            count += len(event.token_ids)
            if first is None:
                first = now
            last = now
    decode = (count - 1) / (last - first) if count > 1 and last > first else 0.0
    return {"ttft_s": first - start, "decode_tokens_per_s": decode, "tokens": count, "total_s": last - start}


def _device_busy_per_step(llm, prompt: list[int], steps: int) -> float | None:
    """CUDA kernel time per decode step, from the profiler over a short greedy generation (None elsewhere)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, profile

        params_prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof_short:
            llm.generate([prompt], params_prefill)
        with profile(activities=[ProfilerActivity.CUDA]) as prof_long:
            llm.generate([prompt], params)

        def kernel_us(prof) -> float:
            return sum(e.self_device_time_total for e in prof.key_averages())

        return (kernel_us(prof_long) - kernel_us(prof_short)) / steps / 1e6
    except Exception as exc:  # the profiler is a measurement aid; its absence is not an error
        print(f"note: no device-busy time ({exc!r})")
        return None


def run_hf(engine_args, prompt: list[int], output_len: int, iters: int) -> dict[str, Any]:
    from pocketllm.runner.model_runner import resolve_device, resolve_dtype

    device = resolve_device(engine_args.device)
    dtype = resolve_dtype(engine_args.dtype, device)
    model = common.hf_peer_model(engine_args.model, engine_args.load_format, dtype, device)
    ids = torch.tensor([prompt], device=device)
    mask = torch.ones_like(ids)

    def timed(n: int) -> float:
        common.sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                           eos_token_id=[], pad_token_id=0)
        common.sync(device)
        return time.perf_counter() - start

    timed(2)
    ttft = statistics.median(timed(1) for _ in range(iters))
    full = statistics.median(timed(output_len) for _ in range(iters))
    decode = (output_len - 1) / (full - ttft) if full > ttft else 0.0
    return {"ttft_s": ttft, "decode_tokens_per_s": decode, "total_s": full, "mode": "generate"}


def _check(args: argparse.Namespace) -> None:
    """The workload's sizes, before anything loads."""
    for flag, value, least in (("--input-len", args.input_len, 1), ("--output-len", args.output_len, 1),
                               ("--num-iters", args.num_iters, 1), ("--warmup-iters", args.warmup_iters, 0)):
        if value < least:
            raise SystemExit(f"pocketllm bench latency: {flag} must be at least {least}, got {value}")


def run(args: argparse.Namespace, engine_args) -> dict[str, Any]:
    from pocketllm.api import LLM
    from pocketllm.runner.model_runner import resolve_device

    _check(args)
    if engine_args.speculative_config is not None:
        from pocketllm.bench import speculative

        return speculative.run(args, engine_args)
    if engine_args.max_model_len is None:
        engine_args = engine_args.replace(max_model_len=args.input_len + args.output_len + 8)
    # Every run sends the same prompt: with prefix caching on, TTFT would time a cache hit, not a prefill.
    engine_args = engine_args.replace(enable_prefix_caching=False)
    device = resolve_device(engine_args.device)

    def ours_run():
        with LLM(engine_args) as llm:
            vocab = common.engine_vocab_size(llm)
            lengths = (args.input_len, args.input_len)
            prompt = common.random_workload(1, lengths, (1, 1), vocab, args.workload_seed).prompts[0]
            wbytes = llm.model_info().weight_bytes
            for _ in range(args.warmup_iters):
                _one_run(llm, prompt, args.output_len)
            runs = [_one_run(llm, prompt, args.output_len) for _ in range(args.num_iters)]
            busy = _device_busy_per_step(llm, prompt, min(32, args.output_len))
            return prompt, wbytes, runs, busy, dict(llm.engine_caps().details)

    prompt, wbytes, runs, busy, details = ours_run()
    common.release_memory()
    decode = statistics.median(r["decode_tokens_per_s"] for r in runs)
    ttft = statistics.median(r["ttft_s"] for r in runs)
    step_s = 1.0 / decode if decode else None
    bandwidth = args.peak_bandwidth_gbs * 1e9 if args.peak_bandwidth_gbs else common.measure_bandwidth(device)
    achieved = wbytes * decode
    ours = {
        "ttft_s": ttft, "decode_tokens_per_s": decode, "decode_step_s": step_s,
        "device_busy_per_step_s": busy,
        "host_exposed_per_step_s": (step_s - busy) if (step_s is not None and busy is not None) else step_s,
        "weight_bytes": wbytes, "achieved_bandwidth_gbs": achieved / 1e9, "bound_bandwidth_gbs": bandwidth / 1e9,
        "bound_tokens_per_s": bandwidth / wbytes, "fraction_of_bound": achieved / bandwidth, "runs": runs,
        "engine": details,
    }
    result: dict[str, Any] = {
        "benchmark": "latency", "date": time.strftime("%Y-%m-%d"), "hardware": common.hardware(),
        "engine_args": dict(vars(engine_args)),
        "workload": {"batch_size": 1, "input_len": args.input_len, "output_len": args.output_len, "greedy": True},
        "pocketllm": ours,
    }
    host = ours["host_exposed_per_step_s"]
    print(f"pocketllm: TTFT {ttft * 1000:.1f} ms, decode {decode:,.1f} tok/s (step {step_s * 1000:.3f} ms"
          + (f", device busy {busy * 1000:.3f} ms, host exposed {host * 1000:.3f} ms" if busy is not None else "")
          + f"); weights {wbytes / 1e9:.3f} GB → {achieved / 1e9:,.0f} GB/s = {ours['fraction_of_bound']:.0%} of "
          f"{bandwidth / 1e9:,.0f} GB/s (bound {ours['bound_tokens_per_s']:,.0f} tok/s)")
    bars = {"pocketllm": decode, "bandwidth bound": ours["bound_tokens_per_s"]}
    if args.peer == "hf":
        peer = run_hf(engine_args, prompt, args.output_len, args.num_iters)
        rate = peer["decode_tokens_per_s"]
        peer["ratio_pocketllm_over_peer"] = decode / rate if rate else None
        result["peer"] = {"hf": peer}
        bars["hf transformers"] = peer["decode_tokens_per_s"]
        print(f"hf transformers: TTFT {peer['ttft_s'] * 1000:.1f} ms, decode {peer['decode_tokens_per_s']:,.1f} "
              f"tok/s; pocketllm / hf = {peer['ratio_pocketllm_over_peer']:.1f}x")
    if args.peer == "llama.cpp":
        from pocketllm.bench import llamacpp_peer

        peer = llamacpp_peer.run_latency(engine_args, prompt, args.output_len, args.num_iters, args.warmup_iters)
        rate = peer["decode_tokens_per_s"]
        peer["ratio_pocketllm_over_peer"] = decode / rate if rate else None
        peer["ttft_ratio_pocketllm_over_peer"] = ttft / peer["ttft_s"] if peer["ttft_s"] else None
        result["peer"] = {"llama.cpp": peer}
        bars["llama.cpp"] = rate
        print(f"llama.cpp: TTFT {peer['ttft_s'] * 1000:.1f} ms, decode {rate:,.1f} tok/s; pocketllm / llama.cpp = "
              f"{peer['ratio_pocketllm_over_peer']:.2f}x decode, {peer['ttft_ratio_pocketllm_over_peer']:.2f}x TTFT "
              f"(load average {common.load_average()})")
    result["plot"] = common.bar_plot(
        common.plot_path(args, args.output_json), f"batch-1 decode, prompt {args.input_len}, output {args.output_len}",
        bars, "tokens/s", f"{result['hardware'].get('gpu', result['hardware']['cpu'])}; "
                          f"{engine_args.model or 'default model'}")
    common.write_json(args.output_json, result)
    return result
