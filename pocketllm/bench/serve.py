"""``pocketllm bench serve``: an HTTP load generator against a running ``pocketllm serve`` (or any server of
the OpenAI completions API that accepts token-id prompts and ``ignore_eos``).

Requests arrive as a Poisson process (``--request-rate`` per second; ``inf`` sends them all at once),
optionally capped at ``--max-concurrency`` in flight. Each streams ``/v1/completions`` with a random
token-id prompt and ``max_tokens`` new tokens with EOS ignored, so it produces exactly that many tokens.
Output tokens are counted from the stream's usage (``stream_options.include_usage``), so a server
without a tokenizer (a dummy preset), which streams empty texts, is measured too. Reported: request/s, output
tok/s, TTFT, TPOT ((end - first token) / (tokens - 1)), ITL (gaps between
streamed chunks; a chunk can carry more than one token when text is held back) and end-to-end latency,
each as mean, p50 and p99. The streams are read by ``sse_client`` (a lean HTTP/1.1 reader) in one or more
processes (``serve_load``), so that the load generator's own work per event stays far below the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

from pocketllm.bench import common, serve_load
from pocketllm.errors import PocketLLMError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="The server (default: %(default)s).")
    parser.add_argument("--api-key", default=None, help="Bearer token, when the server asks for one.")
    parser.add_argument("--served-model", default=None, help="The request's model field (default: the first "
                                                              "model /v1/models lists).")
    parser.add_argument("--num-requests", type=int, default=200, help="Requests to send (default: 200).")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="Poisson arrival rate per second (default: inf = all at once).")
    parser.add_argument("--max-concurrency", type=int, default=None, help="Most requests in flight (default: no cap).")
    parser.add_argument("--min-input-len", type=int, default=100, help="Shortest prompt (default: 100).")
    parser.add_argument("--max-input-len", type=int, default=1024, help="Longest prompt (default: 1024).")
    parser.add_argument("--min-output-len", type=int, default=100, help="Fewest new tokens (default: 100).")
    parser.add_argument("--max-output-len", type=int, default=1024, help="Most new tokens (default: 1024).")
    parser.add_argument("--vocab-size", type=int, default=10000,
                        help="Prompt token ids are drawn from [0, N) (default: 10000, valid in any real vocabulary).")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (default: 0).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the workload and the arrival times.")
    parser.add_argument("--timeout", type=float, default=600.0, help="Seconds one request may take.")
    parser.add_argument("--client-processes", type=int, default=None,
                        help="Processes that send the requests and read the streams (default: 1 for fewer than 64 "
                             "requests, else a quarter of the cores, at most 4).")
    parser.add_argument("--wait-ready", type=float, default=600.0,
                        help="Seconds to wait for the server's /ready to answer 200 before sending anything (a "
                             "server still loading its model is waited for; 0: do not wait; default: %(default)s).")


class ServerNotReady(PocketLLMError):
    """The server did not become ready for the benchmark."""


# /ready refusals that waiting cannot change (anything else, or no answer yet, is a server still starting)
_FINAL_REFUSALS = ("failed to load", "engine has stopped", "shutting down")


async def _wait_ready(client: Any, base_url: str, seconds: float, headers: dict[str, str]) -> None:
    """Poll ``/ready`` until it answers 200; raise ``ServerNotReady`` on a refusal that will not pass or when
    ``seconds`` run out."""
    import httpx

    deadline = time.monotonic() + seconds
    last = "no answer"
    while True:
        try:
            response = await client.get(base_url + "/ready", headers=headers, timeout=5.0)
            if response.status_code == 200:
                return
            try:
                last = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                last = f"/ready answered {response.status_code}"
            if any(phrase in last for phrase in _FINAL_REFUSALS):
                raise ServerNotReady(f"the server at {base_url} cannot serve: {last}")
        except httpx.HTTPError as exc:
            last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if time.monotonic() >= deadline:
            raise ServerNotReady(f"the server at {base_url} was not ready within {seconds:g} s ({last})")
        await asyncio.sleep(0.5)


def _stats(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p99": pct(99)}


def _default_processes(num_requests: int) -> int:
    """Load-generator processes when not given: one for small runs, else a quarter of the cores (at most 4),
    leaving the rest to the server on the same machine."""
    return 1 if num_requests < 64 else max(1, min(4, (os.cpu_count() or 1) // 4))


async def _prepare(args: argparse.Namespace, headers: dict[str, str]) -> str:
    """Wait for the server to be ready; the model name the requests carry."""
    import httpx

    async with httpx.AsyncClient(timeout=args.timeout) as client:
        if args.wait_ready > 0:
            await _wait_ready(client, args.base_url, args.wait_ready, headers)
        if args.served_model is not None:
            return args.served_model
        listed = (await client.get(args.base_url + "/v1/models", headers=headers)).json()
        return listed["data"][0]["id"]


def _run(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    workload = common.random_workload(args.num_requests, (args.min_input_len, args.max_input_len),
                                      (args.min_output_len, args.max_output_len), args.vocab_size, args.seed)
    model = asyncio.run(_prepare(args, headers))
    rng = random.Random(args.seed + 1)
    scheduled, offset = [], 0.0
    for prompt, n in zip(workload.prompts, workload.output_lens):
        body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": args.temperature,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        scheduled.append((offset, body))
        if args.request_rate != float("inf"):
            offset += rng.expovariate(args.request_rate)
    processes = args.client_processes or _default_processes(args.num_requests)
    results, started = serve_load.send_all(args.base_url + "/v1/completions", scheduled, headers, args.timeout,
                                           args.max_concurrency, processes)
    duration = max(r["end"] for r in results) - started
    done = [r for r in results if r["error"] is None and r["chunks"]]
    ttft = [r["chunks"][0] - r["start"] for r in done]
    tpot = [(r["end"] - r["chunks"][0]) / (r["output_tokens"] - 1) for r in done if r["output_tokens"] > 1]
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    e2e = [r["end"] - r["start"] for r in done]
    output_tokens = sum(r["output_tokens"] for r in done)
    return {
        "model": model, "duration_s": duration, "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5], "client_processes": processes,
        "requests_per_s": len(done) / duration, "output_tokens_per_s": output_tokens / duration,
        "total_tokens_per_s": (output_tokens + sum(r["prompt_tokens"] for r in done)) / duration,
        "output_tokens": output_tokens, "ttft_s": _stats(ttft), "tpot_s": _stats(tpot), "itl_s": _stats(itl),
        "e2e_s": _stats(e2e),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    ours = _run(args)
    result = {
        "benchmark": "serve", "date": time.strftime("%Y-%m-%d"), "hardware": common.hardware(),
        "workload": {"base_url": args.base_url, "num_requests": args.num_requests,
                     "request_rate": None if args.request_rate == float("inf") else args.request_rate,
                     "max_concurrency": args.max_concurrency, "input_len": [args.min_input_len, args.max_input_len],
                     "output_len": [args.min_output_len, args.max_output_len], "temperature": args.temperature},
        "pocketllm": ours,
    }

    def ms(d: dict[str, float | None], key: str) -> str:
        return "-" if d[key] is None else f"{d[key] * 1000:.1f}"

    print(f"{ours['completed']} requests ({ours['failed']} failed) in {ours['duration_s']:.2f} s: "
          f"{ours['requests_per_s']:.2f} req/s, {ours['output_tokens_per_s']:,.0f} output tok/s")
    for name in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        d = ours[name]
        print(f"  {name[:-2].upper():5s} mean {ms(d, 'mean')} ms, p50 {ms(d, 'p50')} ms, p99 {ms(d, 'p99')} ms")
    result["plot"] = _plot(common.plot_path(args, args.output_json), ours)
    common.write_json(args.output_json, result)
    return result


def _plot(path: str | None, ours: dict[str, Any]) -> str | None:
    bars = {}
    for name in ("ttft_s", "tpot_s", "itl_s"):
        for key in ("p50", "p99"):
            if ours[name][key] is not None:
                bars[f"{name[:-2].upper()} {key}"] = ours[name][key] * 1000
    return common.bar_plot(path, f"serve: {ours['requests_per_s']:.2f} req/s, "
                                 f"{ours['output_tokens_per_s']:,.0f} output tok/s", bars, "milliseconds")
