"""``pocketllm bench latency --speculative-config …``: batch-1 decode with speculation against the same engine
without it, over the prompt sets of ``speculative_prompts.py``.

Each prompt runs greedy to its natural end (at most ``--output-len`` tokens), one at a time, with and without
speculation: the outputs are the same tokens, so the decode rates compare like for like. The two engines run one
after the other, never side by side: two engines' threads in one process each keep a team of intra-op threads
that wait spinning, which halved the decode rate of both when they took turns prompt by prompt. Reported per set: decode
tokens/s of both (decode tokens over the time from each prompt's first token to its last), the speed-up, the
mean acceptance length (tokens a verify step emits: its accepted proposals plus the target's own token) and the
mean time of a decode step (with speculation, a verify step and the draft model's forwards before it), and an
estimate of a verify step's own time (``_verify_step_ms``).

A checkpoint without a tokenizer (a dummy preset) runs each set's prompts as token ids instead (as many ids as
the text has characters, drawn with a fixed seed). With random weights and ``"forced_acceptance": true`` (and
the target as its own draft, ``"method": "draft_model"``), every verify step keeps its ``k`` proposals: the run
measures the mechanics' cost at an acceptance length of exactly ``k + 1`` (its outputs are not the model's own,
so ``same tokens`` may read False).
"""

from __future__ import annotations

import random
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


def _prompts(llm) -> dict[str, list[str | list[int]]]:
    """Each set's prompts as chats the checkpoint's template renders, or as seeded token ids without a tokenizer."""
    if llm.tokenizer is not None:
        return {name: [llm.render_chat([{"role": "user", "content": text}]) for text in texts]
                for name, texts in PROMPT_SETS.items()}
    draw = random.Random(0)
    vocab = llm.model_info().vocab_size
    return {name: [[draw.randrange(3, vocab) for _ in text] for text in texts] for name, texts in PROMPT_SETS.items()}


def _run_sets(engine_args: EngineArgs, output_len: int, iters: int) -> dict[str, Any]:
    from pocketllm.api import LLM

    with LLM(engine_args) as llm:
        prompts = _prompts(llm)
        _decode(llm, prompts["chat"][0], 16)   # warm-up
        out: dict[str, Any] = {}
        for name, texts in prompts.items():
            before = llm.stats()
            rates, outputs, tokens, seconds = [], [], 0, 0.0
            for _ in range(iters):
                n, t, ids = 0, 0.0, []
                for text in texts:
                    count, elapsed, produced = _decode(llm, text, output_len)
                    n, t = n + count, t + elapsed
                    ids.append(produced)
                rates.append(n / t if t else 0.0)
                outputs, tokens, seconds = ids, tokens + n, seconds + t
            after = llm.stats()
            verify = after["spec_verify_chunks"] - before["spec_verify_chunks"]
            steps = after["num_steps"] - before["num_steps"]
            # Each run's first token comes from its prompt's step; the decode time spans the steps after it.
            decode_steps = steps - iters * len(texts)
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
            pipelined = after["spec_pipelined_verify_chunks"] - before["spec_pipelined_verify_chunks"]
            out[name] = {
                "decode_tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates,
                "decode_tokens": tokens, "decode_s": seconds, "outputs": outputs,
                "verify_steps": verify, "pipelined_verify_chunks": pipelined, "proposed_tokens": proposed,
                "accepted_tokens": accepted,
                "mean_acceptance_length": (1 + accepted / verify) if verify else None,
                "steps": steps, "decode_steps": decode_steps,
                "ms_per_step": 1000 * seconds / decode_steps if decode_steps > 0 else None,
            }
        return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} ms"


def _verify_step_ms(without: dict[str, Any], with_: dict[str, Any]) -> float | None:
    """What a verify step cost, estimated: the speculating run's decode time less its steps without proposals,
    each at the mean step time of the run without speculation, over its verify steps (exact at batch 1 where a
    step without proposals costs what a plain decode step does)."""
    plain_ms, verify = without["ms_per_step"], with_["verify_steps"]
    if plain_ms is None or not verify:
        return None
    return (1000 * with_["decode_s"] - (with_["decode_steps"] - verify) * plain_ms) / verify


def run(args, engine_args: EngineArgs) -> dict[str, Any]:
    """Both runs over every prompt set; prints and returns the comparison."""
    spec = engine_args.speculative_config
    # Each prompt runs once an iteration: no prefix-cache hits between the two engines' runs either way.
    base = engine_args.replace(speculative_config=None, enable_prefix_caching=False)
    load_before = common.load_average()
    plain = _run_sets(base, args.output_len, args.num_iters)
    common.release_memory()
    fast = _run_sets(base.replace(speculative_config=spec), args.output_len, args.num_iters)
    sets: dict[str, Any] = {}
    for name in PROMPT_SETS:
        a, b = plain[name], fast[name]
        same = a["outputs"] == b["outputs"]
        speedup = b["decode_tokens_per_s"] / a["decode_tokens_per_s"] if a["decode_tokens_per_s"] else None
        verify_ms = _verify_step_ms(a, b)
        sets[name] = {"without": {k: v for k, v in a.items() if k != "outputs"},
                      "with": {k: v for k, v in b.items() if k != "outputs"},
                      "speedup": speedup, "same_tokens": same, "verify_step_ms_estimate": verify_ms}
        length = b["mean_acceptance_length"]
        print(f"{name}: {a['decode_tokens_per_s']:.1f} → {b['decode_tokens_per_s']:.1f} decode tok/s "
              f"({'n/a' if speedup is None else f'{speedup:.2f}x'}); mean acceptance length "
              f"{'n/a' if length is None else f'{length:.2f}'} over {b['verify_steps']} verify steps of "
              f"{b['steps']} steps ({b['pipelined_verify_chunks']} verify chunks scheduled while a step ran); "
              f"{_ms(a['ms_per_step'])} → {_ms(b['ms_per_step'])} a decode step, a verify step about "
              f"{_ms(verify_ms)}; same tokens: {same}")
    load_after = common.load_average()
    print(f"load average before {load_before}, after {load_after}")
    result = {
        "benchmark": "latency-speculative", "date": time.strftime("%Y-%m-%d"), "hardware": common.hardware(),
        "speculative_config": spec.to_dict(), "output_len": args.output_len, "num_iters": args.num_iters,
        "load_average": {"before": load_before, "after": load_after}, "sets": sets,
    }
    common.write_json(args.output_json, result)
    return result
