"""Small native engines and sampling parameters for the native plane's tests."""

from __future__ import annotations

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
