"""Small native engines and sampling parameters for the native plane's tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def small_engine(native: Any, path: str, **fields: Any) -> Any:
    """A QwenEngine with a 16 MB KV cache on one thread (libtorch's count is process-wide: a module using this
    restores it with the ``one_thread`` fixture), and ``fields`` set on its options."""
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    options.num_threads = 1
    for name, value in fields.items():
        setattr(options, name, value)
    return native.QwenEngine(path, options)


def greedy_sampling(native: Any, max_new_tokens: int, **fields: Any) -> Any:
    """Batch sampling parameters that ignore EOS (greedy unless ``fields`` say otherwise)."""
    sampling = native.QwenBatchSamplingParams()
    sampling.max_new_tokens = max_new_tokens
    sampling.ignore_eos = True
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


def mixed_prompts(lengths: tuple[int, ...], vocab: int = 49152) -> list[list[int]]:
    """Deterministic prompts of the given lengths, each with its own tokens."""
    return [[(1000 + 7919 * (i + 1) * (n + 3)) % vocab for i in range(length)] for n, length in enumerate(lengths)]


def greedy_by_arch(hf_reference: Any, tiny_checkpoint: Any, prompts: list[list[int]],
                   new_tokens: int) -> Callable[[str], list[list[int]]]:
    """``get(arch)``: transformers' greedy continuations of ``prompts`` on the tiny checkpoint of ``arch``, computed
    once per arch."""
    cache: dict[str, list[list[int]]] = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in cache:
            cache[arch] = hf_reference.greedy(tiny_checkpoint(arch), prompts, new_tokens)
        return cache[arch]

    return get


def run_batched(native: Any, engine: Any, prompts: list[list[int]], new_tokens: int, slots: int, budget: int,
                ngram: tuple[int, int, int] | None = None) -> tuple[dict[int, list[int]], dict[int, int], Any]:
    """Greedy tokens of every prompt, run together through a batch core with ``budget`` prompt tokens a step (and
    prompt lookup with ``ngram`` = (k, min, max)): {index: tokens}, {index: tokens taken from the prefix cache},
    and the core."""
    core = native.QwenBatchCore(engine, slots)
    core.set_prefill_token_budget(budget)
    if ngram is not None:
        core.set_ngram_speculation(*ngram)
    for i, prompt in enumerate(prompts):
        core.add(f"r{i}", prompt, greedy_sampling(native, new_tokens))
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    cached: dict[int, int] = {}
    for _ in range(10000):
        if not core.has_work():
            return tokens, cached, core
        for event in core.step():
            index = int(event.request_id[1:])
            tokens[index].append(event.token)
            cached[index] = event.cached_tokens
    raise AssertionError("the batch core did not finish")
