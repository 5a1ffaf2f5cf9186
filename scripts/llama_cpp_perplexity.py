"""llama.cpp's perplexity on ``scripts/cpu_quality.py``'s text and windows (the same token ids), for comparison
with PocketLLM's formats: llama.cpp multiplies the GGUF's Q4_1 weights by activations quantised to 8 bits per
block of 32 (its Q4_1 x Q8_1 dot products), as PocketLLM's int4 does.

    python scripts/llama_cpp_perplexity.py --rows 1 8

Needs ``pip install 'pocketllm[llamacpp]'``.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from pocketllm.loaders.default_model import default_model_path
from pocketllm.tokenizer.tokenizer import Tokenizer


def main() -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    from cpu_quality import TEXT
    from llama_cpp import Llama

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the engine's default model).")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--length", type=int, default=128)
    args = parser.parse_args()
    path = args.model or default_model_path()
    ids = Tokenizer.from_gguf(path).encode(TEXT, add_special_tokens=True)   # as cpu_quality.py encodes it
    llm = Llama(model_path=path, n_ctx=512, logits_all=True, verbose=False, n_threads=2)
    for rows in args.rows:
        stride = max(1, (len(ids) - args.length) // max(1, rows - 1))
        total, count = 0.0, 0
        for r in range(rows):
            window = ids[r * stride: r * stride + args.length]
            llm.reset()
            llm.eval(window)
            logits = np.asarray(llm.scores[: len(window) - 1], dtype=np.float64)
            logits -= logits.max(axis=-1, keepdims=True)
            logprobs = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
            total -= float(logprobs[np.arange(len(window) - 1), window[1:]].sum())
            count += len(window) - 1
        print(f"llama.cpp: perplexity {math.exp(total / count):.4f} ({rows} rows)", flush=True)


if __name__ == "__main__":
    main()
