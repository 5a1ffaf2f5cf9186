"""Quality of the CPU weight formats through the decode path itself.

Perplexity: a fixed English text, teacher-forced token by token through the CPU decode step and the LM head
that decode runs, ``--rows`` windows of the text at once (each its own KV blocks; one row reads its cache in
place, several gather it, as in serving). Greedy agreement: six chat prompts x ``--tokens`` greedy tokens,
generated one request at a time, compared with the first format's tokens. Top-1 agreement: over the
teacher-forced positions of the largest ``--rows`` pass, how often a format's most likely next token is the
first format's, and the first format's top-2 logit gap where it is not (a format that only flips near ties
keeps that gap small).

    python scripts/cpu_quality.py --formats float32 auto int4 int4-torch int8 bfloat16 --rows 1 8

``int4-torch`` is ``int4`` through torch's int4 kernel (bfloat16 activations) where the CPU would otherwise run
the 4-bit x 8-bit kernel (``pocketllm/layers/q4_linear.py``).

KV-cache dtypes (``--kv-dtypes``): the same measures with the weights fixed (``--kv-format``, default ``auto``:
int4 for the default model here) and only the KV cache's dtype changing, every step (teacher-forced and greedy)
through the PyTorch reference step, the path a float8 cache runs on CPU (the CPU decode fast path reads
bfloat16/float32 rows only, so it is bypassed for every dtype alike). Each dtype is compared with every dtype
listed before it: perplexity, the mean and largest absolute difference of the teacher-forced log-probability of
the text's next token, top-1 agreement, identical greedy prefixes. ``float32`` is not a ``kv_cache_dtype`` value:
its engine is built with a bfloat16 cache, which is then allocated again in float32 before anything runs.

    python scripts/cpu_quality.py --kv-dtypes bfloat16 float32 fp8 --rows 1 8
"""

from __future__ import annotations

import argparse
import contextlib
import math
from types import SimpleNamespace
from typing import NamedTuple

import torch

from pocketllm.api import LLM
from pocketllm.config import EngineArgs
from pocketllm.kernels import cpu_native
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.host_batch import gather_host_batch
from pocketllm.step.scheduled_chunk import ScheduledChunk

TEXT = (
    "The old lighthouse stood at the end of a narrow spit of rock, and for most of the year nobody went "
    "there except the keeper, who rowed out every Monday with bread, oil and a week of newspapers. He had "
    "kept the light for thirty years. In that time the lamp had changed from paraffin to electricity, the "
    "fog horn had been replaced by a recording, and the ships that passed had grown larger and fewer. "
    "What had not changed was the weather. Storms came in from the west in October and stayed until March, "
    "and on the worst nights the spray reached the gallery eighty feet above the sea. The keeper did not "
    "mind. He liked the noise of the wind against the glass, and he liked the quiet mornings afterwards, "
    "when the water lay flat and grey and the gulls came back to sit on the rocks. Each evening he wrote "
    "two lines in the log: the time the lamp was lit and the state of the sea. When the company wrote to "
    "say that the light would be run from the mainland and his post would end in the spring, he read the "
    "letter twice, folded it into the log, and went up the stairs to clean the lens as he did every day. "
    "On his last morning he wrote a third line under the usual two. It said only that the sea was calm."
)

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "How do I reverse a list in Python?",
    "Give me a short tip for sleeping better.",
]


def _chunk(ids: list[int], table: list[int]) -> ScheduledChunk:
    """A decode chunk whose new token is the last of ``ids`` (the others are in the cache)."""
    request = SimpleNamespace(prompt_token_ids=ids[:1], output_token_ids=ids[1:], all_token_ids=ids,
                              num_computed_tokens=len(ids) - 1, num_tokens=len(ids), block_table=table,
                              state_slot=-1)
    return ScheduledChunk(request, 1, len(ids) - 1, True)


@torch.inference_mode()
def perplexity(llm: LLM, ids: list[int], rows: int, length: int,
               top2: list[tuple[int, float]] | None = None, reference_step: bool = False,
               chosen: list[float] | None = None) -> float:
    """exp(mean negative log-likelihood) of ``rows`` windows of ``ids``, teacher-forced through the decode
    step, or the PyTorch reference step with ``reference_step`` (every window's tokens 1..length-1 predicted
    from the ones before). ``top2`` collects each position's (most likely token, its logit's lead over the
    second); ``chosen`` each position's log-probability of the text's next token."""
    runner = llm._client.backend.core.runner
    if runner.cpu_decode is None and not reference_step:
        raise SystemExit("this model has no CPU decode step")
    block = runner.block_size
    per_row = -(-length // block)
    stride = max(1, (len(ids) - length) // max(1, rows - 1))
    windows = [ids[r * stride: r * stride + length] for r in range(rows)]
    tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
    total, count = 0.0, 0
    for pos in range(length - 1):
        chunks = [_chunk(w[: pos + 1], t) for w, t in zip(windows, tables)]
        if reference_step:
            logits = runner.reference_step.run(gather_host_batch(chunks, block))
        else:
            logits = runner.model.compute_logits(runner.cpu_decode.forward(chunks))
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        if top2 is not None:
            best = logprobs.topk(2, dim=-1)
            top2.extend((int(i[0]), float(v[0] - v[1])) for i, v in zip(best.indices, best.values))
        target = torch.tensor([w[pos + 1] for w in windows])
        picked = logprobs.gather(1, target[:, None])[:, 0]
        if chosen is not None:
            chosen.extend(picked.tolist())
        total -= float(picked.sum())
        count += rows
    return math.exp(total / count)


def greedy(llm: LLM, tokens: int) -> list[list[int]]:
    """Greedy tokens of each chat prompt, one request at a time."""
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [llm.chat([{"role": "user", "content": p}], params)[0].token_ids for p in PROMPTS]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class KvRun(NamedTuple):
    """What one KV-cache dtype measured: perplexity per row count, and over the largest row count's positions
    each one's log-probability of the text's next token and (most likely token, top-2 logit gap); the greedy
    tokens of every chat prompt."""

    perplexity: dict[int, float]
    chosen: list[float]
    top2: list[tuple[int, float]]
    greedy: list[list[int]]


def measure_kv(kv_dtype: str, args: argparse.Namespace) -> KvRun:
    """The measures of one KV-cache dtype, every step through the reference step."""
    extra = {} if args.model is None else {"model": args.model}
    cache = "bfloat16" if kv_dtype == "float32" else kv_dtype
    llm = LLM(EngineArgs(device="cpu", max_model_len=512, cpu_weight_format=args.kv_format, kv_cache_dtype=cache,
                         num_kv_blocks=args.kv_blocks, **extra))
    with llm:
        runner = llm._client.backend.core.runner
        if kv_dtype == "float32":
            runner.kv_dtype = torch.float32
            runner.allocate_kv_cache(runner.num_blocks)
        runner.step_backends = [runner.host_step]   # the reference step for every dtype alike
        dtype = runner.attention_layers[0].k_cache.dtype
        resolved = llm.engine_caps().details.get("cpu_weight_format", args.kv_format)
        print(f"kv {kv_dtype}: cache {dtype}, weights {resolved}", flush=True)
        ids = llm._client.encode_prompt(TEXT)
        top2: list[tuple[int, float]] = []
        chosen: list[float] = []
        widest = max(args.rows)
        ppl = {rows: perplexity(llm, ids, rows, args.length, top2 if rows == widest else None, True,
                                chosen if rows == widest else None) for rows in args.rows}
        tokens = greedy(llm, args.tokens)
    return KvRun(ppl, chosen, top2, tokens)


def compare_kv(name: str, run: KvRun, base_name: str, base: KvRun) -> str:
    """One line: ``run`` against ``base``."""
    delta = (torch.tensor(run.chosen) - torch.tensor(base.chosen)).abs()
    flips = [gap for (token, _), (ref_token, gap) in zip(run.top2, base.top2) if token != ref_token]
    top1 = 1 - len(flips) / max(1, len(run.top2))
    widest = f"{max(flips):.3f}" if flips else "-"
    ppl = ", ".join(f"{run.perplexity[r]:.4f} vs {base.perplexity[r]:.4f} ({r} rows, "
                    f"{run.perplexity[r] - base.perplexity[r]:+.4f})" for r in run.perplexity)
    agree = [common_prefix(a, b) for a, b in zip(run.greedy, base.greedy)]
    return (f"kv {name} vs {base_name}: perplexity {ppl}; chosen-token |logprob delta| mean {float(delta.mean()):.4f}"
            f" max {float(delta.max()):.4f} over {delta.numel()} positions; teacher-forced top-1 agreement "
            f"{top1:.4f} ({len(flips)} differ; {base_name}'s top-2 logit gap there at most {widest}); identical "
            f"greedy prefix: {agree}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model (default: the engine's default model).")
    parser.add_argument("--formats", nargs="+", default=["auto", "int4"],
                        help="cpu_weight_format values, or fp8 (quantization='fp8').")
    parser.add_argument("--kv-dtypes", nargs="+", default=None, choices=["bfloat16", "float32", "fp8"],
                        help="Compare these KV-cache dtypes instead of weight formats (reference step).")
    parser.add_argument("--kv-format", default="auto", help="cpu_weight_format of the --kv-dtypes runs.")
    parser.add_argument("--kv-blocks", type=int, default=256, help="KV blocks of the --kv-dtypes runs.")
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 8], help="Rows per teacher-forced step.")
    parser.add_argument("--length", type=int, default=128, help="Tokens per window.")
    parser.add_argument("--tokens", type=int, default=64, help="Greedy tokens per chat prompt.")
    args = parser.parse_args()
    if args.kv_dtypes:
        runs: dict[str, KvRun] = {}
        for kv_dtype in args.kv_dtypes:
            run = measure_kv(kv_dtype, args)
            print(f"kv {kv_dtype}: perplexity " + ", ".join(f"{p:.4f} ({r} rows)" for r, p in run.perplexity.items()),
                  flush=True)
            for base_name, base in runs.items():
                print(compare_kv(kv_dtype, run, base_name, base), flush=True)
            runs[kv_dtype] = run
        return
    reference = None
    reference_top2: list[tuple[int, float]] | None = None
    for fmt in args.formats:
        extra = {} if args.model is None else {"model": args.model}
        kernels = cpu_native.switched_off() if fmt == "int4-torch" else contextlib.nullcontext()
        with kernels:   # the kernels are chosen while the layers and the decode step are built
            if fmt == "fp8":    # quantization="fp8": float8 weights, widened per product on CPU (a reference)
                extra.update(quantization="fp8", cpu_weight_format="float32")
            else:
                extra.update(cpu_weight_format=fmt.removesuffix("-torch"))
            llm = LLM(EngineArgs(device="cpu", max_model_len=512, **extra))
        with llm:
            resolved = llm.engine_caps().details.get("cpu_weight_format", fmt)
            ids = llm._client.encode_prompt(TEXT)
            top2: list[tuple[int, float]] = []
            ppl = {rows: perplexity(llm, ids, rows, args.length, top2 if rows == max(args.rows) else None)
                   for rows in args.rows}
            tokens = greedy(llm, args.tokens)
        reference = reference or tokens
        reference_top2 = reference_top2 or top2
        agree = [common_prefix(a, b) for a, b in zip(tokens, reference)]
        flips = [gap for (token, _), (ref_token, gap) in zip(top2, reference_top2) if token != ref_token]
        top1 = 1 - len(flips) / max(1, len(top2))
        widest = f"{max(flips):.3f}" if flips else "-"
        print(f"{fmt} (runs as {resolved}): perplexity " + ", ".join(f"{p:.4f} ({r} rows)" for r, p in ppl.items())
              + f"; identical greedy prefix vs {args.formats[0]}: {agree}; teacher-forced top-1 agreement "
              f"{top1:.4f} ({len(flips)} of {len(top2)} differ; {args.formats[0]}'s top-2 logit gap there at most "
              f"{widest})", flush=True)


if __name__ == "__main__":
    main()
