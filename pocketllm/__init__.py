"""PocketLLM: a small, fast LLM inference and serving engine.

Names are imported on first use, so that torch-free parts (``pocketllm.protocol``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "pocketllm.api",
    "AsyncLLM": "pocketllm.api",
    "EngineArgs": "pocketllm.config",
    "EngineCaps": "pocketllm.backends.base",
    "SamplingParams": "pocketllm.sampling_params",
    "StructuredOutput": "pocketllm.sampling_params",
    "RequestOutput": "pocketllm.outputs",
    "TokenEvent": "pocketllm.outputs",
    "Usage": "pocketllm.outputs",
    "PocketLLMError": "pocketllm.errors",
    "InvalidRequestError": "pocketllm.errors",
    "UnsupportedFeatureError": "pocketllm.errors",
    "CheckpointError": "pocketllm.errors",
    "EngineDeadError": "pocketllm.errors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pocketllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
