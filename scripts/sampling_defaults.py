"""How sampling settings end the default model's answers: the measurement behind ``FALLBACK_SAMPLING``
(``pocketllm/loaders/generation_defaults.py``).

For each setting, ``--samples`` sampled answers to each chat prompt (the README's two and six everyday ones),
``--max-tokens`` at most: how many end with EOS within 128 tokens, the median length, and how many loop (some
run of four tokens occurs three times or more).

    python scripts/sampling_defaults.py --samples 8
    python scripts/sampling_defaults.py --samples 16 --prompts 2 --settings "T0.7 p0.9" "T0.5 p0.9" "T0.3 p0.9"
"""

from __future__ import annotations

import argparse
import statistics

from pocketllm import LLM, EngineArgs, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Give me a short tip for sleeping better.",
    "Write a short poem about a lighthouse.",
]

SETTINGS = {
    "T0.7 p0.9": {"temperature": 0.7, "top_p": 0.9},
    "T0.7 p0.9 rp1.05": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.05},
    "T0.7 p0.9 rp1.1": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.1},
    "T0.7 p0.9 rp1.2": {"temperature": 0.7, "top_p": 0.9, "repetition_penalty": 1.2},
    "T1.0": {"temperature": 1.0},
    "T0.5 p0.9": {"temperature": 0.5, "top_p": 0.9},
    "T0.3 p0.9": {"temperature": 0.3, "top_p": 0.9},
    "T0.2 p0.9": {"temperature": 0.2, "top_p": 0.9},
}


def loops(tokens: list[int], n: int = 4, times: int = 3) -> bool:
    """Whether some run of ``n`` tokens occurs ``times`` times or more."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens) - n + 1):
        key = tuple(tokens[i:i + n])
        counts[key] = counts.get(key, 0) + 1
        if counts[key] >= times:
            return True
    return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8, help="Sampled answers per prompt and setting.")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="Use the first N prompts.")
    parser.add_argument("--show", default="Write a haiku about the sea", help="Print this prompt's first answer.")
    args = parser.parse_args()
    del PROMPTS[args.prompts:]
    with LLM(EngineArgs(max_model_len=512, seed=0)) as llm:
        fmt = llm.engine_caps().details.get("cpu_weight_format")
        print(f"cpu_weight_format {fmt}; {args.samples} samples per prompt, {len(PROMPTS)} prompts", flush=True)
        prompts = [llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": p}]), add_special_tokens=False)
                   for p in PROMPTS]
        for name in args.settings:
            params = SamplingParams(max_tokens=args.max_tokens, **SETTINGS[name])
            batch = [p for p in prompts for _ in range(args.samples)]
            outputs = llm.generate(batch, params)
            stops = [o.finish_reason == "stop" and len(o.token_ids) < 128 for o in outputs]
            looping = [loops(o.token_ids) for o in outputs]
            per_prompt = [sum(stops[i * args.samples:(i + 1) * args.samples]) for i in range(len(PROMPTS))]
            median = statistics.median(len(o.token_ids) for o in outputs)
            print(f"{name:18s} EOS within 128 tokens {sum(stops)}/{len(stops)} (per prompt {per_prompt}); "
                  f"median {median:.0f} tokens; loops {sum(looping)}/{len(looping)}", flush=True)
            if args.show in PROMPTS:
                shown = outputs[PROMPTS.index(args.show) * args.samples]
                print(f"    {args.show!r}: {shown.text!r} [{shown.finish_reason}]", flush=True)


if __name__ == "__main__":
    main()
