"""How far a float8 KV cache moves the tiny test models' greedy choices (CUDA): for many prompts, each generated
token's logit gap to the fp32 argmax, as a fraction of the largest |logit|, with the cache in bf16 and in float8.
``test_engine_bf16_diverges_only_at_near_ties`` takes its margins from this distribution.

    python scripts/fp8_gap.py [--prompts 48] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import test_kernels_gpu as kernels_tests  # noqa: E402


def gaps(arch: str, kv: str, prompts: list[list[int]], new_tokens: int) -> list[float]:
    kernels_tests.PROMPTS = prompts   # _greedy runs the module's prompt list
    outputs = kernels_tests._greedy(arch, "cuda", "bfloat16", new_tokens, kv_cache_dtype=kv)
    model = kernels_tests._tiny_model(arch)
    found = []
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1:-1].float()
        for step, token in enumerate(out):
            row = logits[step]
            found.append(float(row.max() - row[token]) / float(row.abs().max()))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (int(torch.randint(4, 120, (1,), generator=generator)),),
                             generator=generator).tolist() for _ in range(args.prompts)]
    print("arch kv tokens p50 p90 p99 max (gap / largest |logit|)")
    for arch in ("llama", "qwen3"):
        for kv in ("auto", "fp8"):
            values = torch.tensor(gaps(arch, kv, prompts, args.new_tokens))
            q = torch.quantile(values, torch.tensor([0.5, 0.9, 0.99])).tolist()
            print(f"{arch} {kv} {values.numel()} {q[0]:.4f} {q[1]:.4f} {q[2]:.4f} {values.max():.4f}")


if __name__ == "__main__":
    main()
