"""The native module ``pocketllm_cpp`` as the backends see it: whether it imports, and what it runs."""

from __future__ import annotations

import json
import os
from typing import Any

from pocketllm.errors import UnsupportedFeatureError

# model_type values of config.json (a text_config's for a multimodal checkpoint) that the native engine runs:
# Qwen3 and Qwen3.5, dense and MoE.
NATIVE_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
# The spec's auto rule: the native plane is picked only for Qwen3.5 safetensors checkpoints.
AUTO_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# Whether backend='auto' may pick the native plane at all. Off: the native engine runs Qwen3.5 (backend='cpp'),
# but the Torch engine stays the default for it until the whole Qwen3.5 test set passes on the native plane (the
# native engine has no prefix caching, speculation or structured outputs for it).
AUTO_SELECTS_NATIVE = False

BUILD_HINT = ("build it with `POCKETLLM_BUILD_CPP=1 pip install --no-build-isolation .` or `make native` "
              "(docs/native.md)")


def import_native() -> Any | None:
    """The ``pocketllm_cpp`` module, or None when it is not built."""
    try:
        import pocketllm_cpp
    except ImportError:
        return None
    return pocketllm_cpp


def require_native() -> Any:
    """The ``pocketllm_cpp`` module; UnsupportedFeatureError naming the build command when it is absent."""
    module = import_native()
    if module is None:
        raise UnsupportedFeatureError(f"backend='cpp' needs the native module pocketllm_cpp, which is not built: "
                                      f"{BUILD_HINT}")
    return module


def safetensors_model_type(model: str | None) -> str | None:
    """config.json's model_type of a safetensors checkpoint directory (a text_config's for a multimodal one);
    None for anything else (a GGUF file, a preset name, a missing path)."""
    if model is None or not os.path.isdir(model):
        return None
    if not any(name.endswith(".safetensors") for name in os.listdir(model)):
        return None
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as handle:
            config = json.load(handle)
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    if isinstance(text, dict) and "model_type" in text:
        return str(text["model_type"])
    model_type = config.get("model_type")
    return str(model_type) if model_type is not None else None


def auto_picks_native(model: str | None, load_format: str) -> bool:
    """The spec's rule for backend='auto': native only when AUTO_SELECTS_NATIVE is on, the module imports and
    the checkpoint is a Qwen3.5 safetensors model the native engine runs (the flag is off today, so auto stays
    on Torch)."""
    if not AUTO_SELECTS_NATIVE or load_format not in ("auto", "safetensors"):
        return False
    model_type = safetensors_model_type(model)
    runnable = model_type in AUTO_MODEL_TYPES and model_type in NATIVE_MODEL_TYPES
    return runnable and import_native() is not None
