"""The native module ``pocketllm_cpp`` as the backends see it: whether it imports, what it runs, which engine
options it refuses, and the spec's rule for ``backend='auto'``."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pocketllm.config import EngineArgs
from pocketllm.errors import CheckpointError, InvalidRequestError, UnsupportedFeatureError
from pocketllm.loaders.default_model import default_model_path
from pocketllm.loaders.gguf_file import GGUFFile

logger = logging.getLogger("pocketllm.backend")

# model_type values of config.json (a text_config's for a multimodal checkpoint) that the native engine runs:
# Qwen3 and Qwen3.5, dense and MoE.
NATIVE_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
# general.architecture values of a GGUF file that the native engine reads (dense models: the default model's
# llama, and qwen2/qwen3).
NATIVE_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# The spec's auto rule: the native plane is picked only for Qwen3.5 safetensors checkpoints, dense and MoE
# (a multimodal ``qwen3_5``/``qwen3_5_moe`` checkpoint reads as its text_config's model_type).
AUTO_MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
# backend_options the native plane understands.
KNOWN_OPTIONS = frozenset({"eos_token_id"})

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


def gguf_file(model: str | None) -> str | None:
    """The GGUF file a model names: the file itself, or the one a directory without safetensors holds (the default
    model's when ``model`` is None); None for anything else."""
    if model is None:
        try:
            return default_model_path()
        except CheckpointError:
            return None
    # ".gguf" in lower case: the native engine tells a GGUF from a directory by that suffix.
    if os.path.isdir(model):
        names = sorted(os.listdir(model))
        ggufs = [n for n in names if n.endswith(".gguf") and not n.startswith("mmproj")]
        if not ggufs or any(n.endswith(".safetensors") for n in names):
            return None
        return os.path.join(model, ggufs[0])
    return model if model.endswith(".gguf") and os.path.isfile(model) else None


def gguf_architecture(path: str) -> str | None:
    """A GGUF file's general.architecture (None when unreadable)."""
    try:
        arch = GGUFFile(path).metadata.get("general.architecture")
    except CheckpointError:
        return None
    return str(arch) if arch is not None else None


def native_model_path(args: EngineArgs) -> str:
    """The path the native engine loads: a safetensors directory, or a GGUF file (the default model's when none
    is named)."""
    return gguf_file(args.model) or os.fspath(args.model)


def native_backend() -> str | None:
    """The device backend the native module was built for (``cpu`` or ``cuda``), None when it is not built."""
    module = import_native()
    return None if module is None else str(module.backend)


def _device_refused(device: str) -> bool:
    """Whether the native plane cannot run on ``device``: CUDA needs a CUDA build of the module (imported only
    to ask that, where CUDA is asked for)."""
    return device == "cuda" and native_backend() != "cuda"


def refused_options(args: EngineArgs) -> list[str]:
    """The engine options the native plane cannot honour, each as ``name=value`` (it runs in one process on the
    CPU, or on a CUDA device where the module is a CUDA build, in float32 or a Q4_1 GGUF's 4-bit layers on the CPU,
    speculating by prompt lookup only)."""
    spec = args.speculative_config
    refusals = {
        "device": _device_refused(args.device),
        "dtype": args.dtype not in ("auto", "float32"),
        "cpu_weight_format": args.cpu_weight_format not in ("auto", "float32"),
        "cpu_compile": args.cpu_compile,
        "quantization": args.quantization is not None,
        "kv_cache_dtype": args.kv_cache_dtype != "auto",
        "async_scheduling": args.async_scheduling == "on",
        "tensor_parallel_size": args.tensor_parallel_size > 1,
        "speculative_config": spec is not None and (spec.method != "ngram" or spec.forced_acceptance),
        "load_format": args.load_format != "auto",   # "dummy": random weights the native loader cannot make
    }
    return [f"{name}={getattr(args, name)!r}" for name, refused in refusals.items() if refused]


def unknown_options(args: EngineArgs) -> list[str]:
    """backend_options keys the native plane does not understand."""
    return sorted(set(args.backend_options) - KNOWN_OPTIONS)


def check_args(args: EngineArgs) -> None:
    """For backend='cpp': UnsupportedFeatureError for any engine option or checkpoint the native plane cannot
    honour, InvalidRequestError for unknown backend_options. Reads config.json or the GGUF metadata only, and
    touches no device (the module is imported only where CUDA is asked for, to ask what it was built for)."""
    unknown = unknown_options(args)
    if unknown:
        raise InvalidRequestError(f"backend_options {unknown} are not understood by the cpp backend "
                                  f"(known: {', '.join(sorted(KNOWN_OPTIONS))})", param="backend_options")
    asked = refused_options(args)
    if asked:
        raise UnsupportedFeatureError(
            f"backend='cpp' (the native plane) runs on the CPU (float32, or a Q4_1 GGUF's 4-bit layers) or, built "
            f"with -DPOCKET_BACKEND=cuda, on a CUDA device (float32), in one process, speculating by prompt lookup "
            f"(method 'ngram') only; it cannot honour {', '.join(asked)} (use backend='torch')")
    model_type = safetensors_model_type(args.model)
    if model_type in NATIVE_MODEL_TYPES:
        return
    path = gguf_file(args.model)
    arch = gguf_architecture(path) if path is not None else None
    if arch in NATIVE_GGUF_ARCHITECTURES:
        return
    if model_type:
        what = f"model_type {model_type!r}"
    elif arch:
        what = f"a GGUF file of architecture {arch!r}"
    else:
        what = "neither a safetensors checkpoint directory nor a GGUF file"
    raise UnsupportedFeatureError(f"backend='cpp' (the native plane) runs Qwen3 and Qwen3.5 (dense and MoE) "
                                  f"safetensors checkpoints ({', '.join(NATIVE_MODEL_TYPES)}) and GGUF files of the "
                                  f"{', '.join(NATIVE_GGUF_ARCHITECTURES)} architectures; {args.model!r} is {what}")


def _cuda_available() -> bool:
    """Whether device='auto' resolves to CUDA, asked as the Torch runner asks it (``torch.cuda.is_available``
    counts devices; it creates no CUDA context)."""
    import torch

    return torch.cuda.is_available()


def auto_picks_native(args: EngineArgs) -> bool:
    """The spec's rule for backend='auto': the native plane only when ``pocketllm_cpp`` imports, the checkpoint
    is a Qwen3.5 (dense or MoE) safetensors directory, the engine options ask for nothing the native plane
    refuses, and the device is one the module was built for (device='auto' with CUDA available needs a CUDA
    build). Anything else stays on Torch; when the module is built and a Qwen3.5 checkpoint stays there, one INFO
    line names the options that kept it."""
    module = import_native() if safetensors_model_type(args.model) in AUTO_MODEL_TYPES else None
    if module is None:
        return False
    asked = refused_options(args) + [f"backend_options={key!r}" for key in unknown_options(args)]
    if not asked and args.device == "auto" and module.backend != "cuda" and _cuda_available():
        asked = ["device='auto' (CUDA is available; this build of the native plane runs on the CPU)"]
    if asked:
        logger.info("backend='auto' runs this Qwen3.5 checkpoint on the Torch backend: the native plane cannot "
                    "honour %s (backend='cpp' refuses it)", ", ".join(asked))
        return False
    return True
