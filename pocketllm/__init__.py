"""PocketLLM: a small, fast LLM inference and serving engine."""

from pocketllm.api import LLM, AsyncLLM
from pocketllm.backends.base import EngineCaps
from pocketllm.config import EngineArgs
from pocketllm.errors import (
    CheckpointError,
    EngineDeadError,
    InvalidRequestError,
    PocketLLMError,
    UnsupportedFeatureError,
)
from pocketllm.outputs import RequestOutput, TokenEvent, Usage
from pocketllm.sampling_params import SamplingParams

__all__ = [
    "LLM", "AsyncLLM", "EngineArgs", "EngineCaps", "SamplingParams", "RequestOutput", "TokenEvent", "Usage",
    "PocketLLMError", "InvalidRequestError", "UnsupportedFeatureError", "CheckpointError", "EngineDeadError",
]
