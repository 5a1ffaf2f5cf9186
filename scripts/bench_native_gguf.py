"""Batch-1 decode of the default model's GGUF: ``pocketllm_engine`` with ``--weight-format auto`` (4-bit layers
through PocketLLM's AVX-512 VNNI kernel where the CPU has it) and ``float32``, and the Torch backend's default
(``cpu_weight_format="auto"``: int4 for a Q4_1 GGUF), each in a process of its own, after one warm-up request.

Prints one JSON line per run: decode tokens/s over the tokens after the first, and the load average then."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

PROMPT = "Once upon a time"


def native(engine: str, model: str, weight_format: str, tokens: int, threads: int) -> dict:
    """One run of the executable: a warm-up request, then the measured one (its usage line times the decode)."""
    requests = [{"op": "generate", "id": "warm", "prompt": PROMPT, "n": 8, "temp": 0},
                {"op": "generate", "id": "run", "prompt": PROMPT, "n": tokens, "temp": 0}]
    # --max-seqs 1: the measured request runs alone, after the warm-up (batch 1).
    cmd = [engine, "--model", model, "--ctx", "512", "--max-seqs", "1", "--weight-format", weight_format]
    if threads:
        cmd += ["--threads", str(threads)]
    lines = "".join(json.dumps(r) + "\n" for r in requests)
    out = subprocess.run(cmd, input=lines.encode(), capture_output=True, timeout=600, check=True)
    for line in out.stdout.decode().splitlines():
        answer = json.loads(line)
        if answer.get("id") == "run" and answer.get("done"):
            usage = answer["usage"]
            return {"gen_tokens": usage["gen_tokens"],
                    "decode_tok_s": round((usage["gen_tokens"] - 1) / (usage["decode_ms"] / 1000), 2)}
    raise RuntimeError(out.stderr.decode(errors="replace"))


def torch_default(model: str, tokens: int) -> dict:
    code = f"""
import json
from pocketllm import LLM, EngineArgs, SamplingParams
with LLM(EngineArgs(model={model!r}, cpu_kv_cache_gb=0.25)) as llm:
    ids = llm.tokenizer.encode({PROMPT!r}, add_special_tokens=False)
    llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    usage = llm.generate([ids], SamplingParams(max_tokens={tokens}, temperature=0.0, ignore_eos=True))[0].usage
print(json.dumps({{"gen_tokens": usage.completion_tokens,
                  "decode_tok_s": round((usage.completion_tokens - 1) / usage.decode_time_s, 2)}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=600, check=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    from pocketllm.loaders.default_model import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine",
                        default=os.environ.get("POCKETLLM_ENGINE", "cpp_engine/build-python/pocketllm_engine"))
    parser.add_argument("--model", default=None, help="a GGUF (default: the default model's)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="pocketllm_engine --threads (0: libtorch's default)")
    parser.add_argument("--only", choices=("auto", "float32", "torch"), action="append")
    args = parser.parse_args()
    model = args.model or default_model_path()
    for run in range(1, args.runs + 1):
        for which in args.only or ("auto", "float32", "torch"):
            before = os.getloadavg()[0]
            start = time.time()
            result = (torch_default(model, args.tokens) if which == "torch"
                      else native(args.engine, model, which, args.tokens, args.threads))
            print(json.dumps({"run": run, "backend": "torch" if which == "torch" else f"native-{which}", **result,
                              "load_before": round(before, 2), "load_after": round(os.getloadavg()[0], 2),
                              "wall_s": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
