"""PocketLLM's native plane: a C++ Qwen3 and Qwen3.5 engine (``QwenEngine``) and its continuous-batching
scheduler."""

import os

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


def engine_executable() -> str | None:
    """The path of the ``pocketllm_engine`` executable installed with this module (``POCKETLLM_BUILD_CPP=1 pip
    install``), or None where the module comes from a build tree (``make native`` leaves the executable in
    ``cpp_engine/build-python``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "pocketllm_engine")
    return path if os.access(path, os.X_OK) else None
