"""``pocketllm bench latency --speculative-config …``: batch-1 decode with speculation against the same engine
without it, over the prompt sets of ``speculative_prompts.py``.

Each prompt runs greedy to its natural end (at most ``--output-len`` tokens), one at a time, on an engine with
and one without speculation, taking turns: the outputs are the same tokens, so the decode rates compare like for
like. Reported per set: decode
tokens/s of both (decode tokens over the time from each prompt's first token to its last), the speed-up, and the
mean acceptance length (tokens a verify step emits: its accepted proposals plus the target's own token).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from pocketllm.bench import common
from pocketllm.bench.speculative_prompts import PROMPT_SETS
from pocketllm.config import EngineArgs
from pocketllm.sampling_params import SamplingParams


def _decode(llm, prompt: str, output_len: int) -> tuple[int, float, list[int]]:
    """Decode tokens (after the first), their time, and the tokens of one greedy run."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0)
    first = last = None
    tokens: list[int] = []
    for event in llm.generate_stream(prompt, params):
        now = time.perf_counter()
        if event.token_ids:
            tokens.extend(event.token_ids)
            first = now if first is None else first
            last = now
    return max(0, len(tokens) - 1), (last - first) if first is not None else 0.0, tokens


def _stats_delta(before: dict, after: dict) -> dict[str, Any]:
    verify = after["spec_verify_chunks"] - before["spec_verify_chunks"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {"verify_steps": verify, "accepted_tokens": accepted,
            "proposed_tokens": after["spec_proposed_tokens"] - before["spec_proposed_tokens"],
            "mean_acceptance_length": (1 + accepted / verify) if verify else None,
            "steps": after["num_steps"] - before["num_steps"]}


def _run_sets(engines: dict[str, Any], output_len: int, iters: int) -> dict[str, dict[str, Any]]:
    """Every prompt set on every engine, the engines taking turns prompt by prompt (so that a shared machine's
    load changes hit both alike)."""
    first = next(iter(engines.values()))
    prompts = {name: [first.render_chat([{"role": "user", "content": text}]) for text in texts]
               for name, texts in PROMPT_SETS.items()}
    for llm in engines.values():
        _decode(llm, prompts["chat"][0], 16)   # warm-up
    results: dict[str, dict[str, Any]] = {}
    for name, texts in prompts.items():
        before = {key: llm.stats() for key, llm in engines.items()}
        rates: dict[str, list[float]] = {key: [] for key in engines}
        totals = {key: [0, 0.0] for key in engines}
        outputs: dict[str, list[list[int]]] = {key: [] for key in engines}
        for _ in range(iters):
            run = {key: [0, 0.0] for key in engines}
            for key in engines:
                outputs[key] = []
            for text in texts:
                for key, llm in engines.items():
                    count, elapsed, produced = _decode(llm, text, output_len)
                    run[key][0] += count
                    run[key][1] += elapsed
                    outputs[key].append(produced)
            for key, (count, elapsed) in run.items():
                rates[key].append(count / elapsed if elapsed else 0.0)
                totals[key][0] += count
                totals[key][1] += elapsed
        results[name] = {key: {"decode_tokens_per_s": statistics.median(rates[key]), "runs_tokens_per_s": rates[key],
                               "decode_tokens": totals[key][0], "decode_s": totals[key][1],
                               "outputs": outputs[key], **_stats_delta(before[key], llm.stats())}
                         for key, llm in engines.items()}
    return results


def run(args, engine_args: EngineArgs) -> dict[str, Any]:
    """Both runs over every prompt set; prints and returns the comparison."""
    spec = engine_args.speculative_config
    # Each prompt runs once an iteration: no prefix-cache hits between the two engines' runs either way.
    base = engine_args.replace(speculative_config=None, enable_prefix_caching=False)
    from pocketllm.api import LLM

    load_before = common.load_average()
    with LLM(base) as plain_llm, LLM(base.replace(speculative_config=spec)) as spec_llm:
        runs = _run_sets({"without": plain_llm, "with": spec_llm}, args.output_len, args.num_iters)
    sets: dict[str, Any] = {}
    for name in PROMPT_SETS:
        a, b = runs[name]["without"], runs[name]["with"]
        same = a["outputs"] == b["outputs"]
        speedup = b["decode_tokens_per_s"] / a["decode_tokens_per_s"] if a["decode_tokens_per_s"] else None
        sets[name] = {"without": {k: v for k, v in a.items() if k != "outputs"},
                      "with": {k: v for k, v in b.items() if k != "outputs"},
                      "speedup": speedup, "same_tokens": same}
        length = b["mean_acceptance_length"]
        print(f"{name}: {a['decode_tokens_per_s']:.1f} → {b['decode_tokens_per_s']:.1f} decode tok/s "
              f"({'n/a' if speedup is None else f'{speedup:.2f}x'}); mean acceptance length "
              f"{'n/a' if length is None else f'{length:.2f}'} over {b['verify_steps']} verify steps of "
              f"{b['steps']} steps; same tokens: {same}")
    load_after = common.load_average()
    print(f"load average before {load_before}, after {load_after}")
    result = {
        "benchmark": "latency-speculative", "date": time.strftime("%Y-%m-%d"), "hardware": common.hardware(),
        "speculative_config": spec.to_dict(), "output_len": args.output_len, "num_iters": args.num_iters,
        "load_average": {"before": load_before, "after": load_after}, "sets": sets,
    }
    common.write_json(args.output_json, result)
    return result
