"""PocketLLM's native plane: a C++ Qwen3 and Qwen3.5 engine (``QwenEngine``) and its continuous-batching
scheduler."""

import torch  # noqa: F401  (loads libtorch, which the native library links against)

from ._native import (  # noqa: F401
    QwenBatchCore,
    QwenBatchEvent,
    QwenBatchResult,
    QwenBatchSamplingParams,
    QwenBatchScheduler,
    QwenEngine,
    QwenEngineCaps,
    QwenEngineOptions,
    backend,
    q4_kernel_supported,
    q4_linear,
    q4_pack,
)
