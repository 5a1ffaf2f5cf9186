"""Hugging Face checkpoint directories: config.json, generation_config.json and safetensors weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pocketllm.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(directory: str) -> Any:
    """``config.json`` of a local directory as a transformers config (never touches the network)."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(directory, "config.json")):
        raise CheckpointError(f"{directory!r} has no config.json")
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as exc:
        raise CheckpointError(f"cannot read config.json in {directory!r}: {exc}") from exc
    return text_part(config)


# Multimodal checkpoints served text-only (model_type → the text model's architecture). Their weights
# keep the multimodal names; the model's ``checkpoint_name`` skips the vision tower.
TEXT_ONLY_MODEL_TYPES = {"qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
                         "gemma3": "Gemma3ForCausalLM"}


def text_part(config: Any) -> Any:
    """The nested ``text_config`` of a checkpoint in ``TEXT_ONLY_MODEL_TYPES`` (other configs unchanged)."""
    text = getattr(config, "text_config", None)
    architecture = TEXT_ONLY_MODEL_TYPES.get(getattr(config, "model_type", None))
    if architecture is None or text is None:
        return config
    text.architectures = [architecture]
    # The LM head is tied (or not) by the outer config, as transformers does for these models.
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    return text


def read_generation_config(directory: str) -> dict[str, Any]:
    """Parsed ``generation_config.json``, or ``{}`` when the directory has none."""
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot parse {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path!r} does not hold a JSON object")
    return data


def safetensors_files(directory: str) -> list[str]:
    """The weight files of a directory: those named by the shard index, else every ``*.safetensors``."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as handle:
                weight_map = json.load(handle)["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise CheckpointError(f"cannot parse {index!r}: {exc}") from exc
        names = sorted(set(weight_map.values()))
        missing = [name for name in names if not os.path.isfile(os.path.join(directory, name))]
        if missing:
            raise CheckpointError(f"shards named in {INDEX_FILE} are missing from {directory!r}: {missing}")
    else:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    return [os.path.join(directory, name) for name in names]


@contextmanager
def _open_safetensors(path: str) -> Iterator[Any]:
    """``safe_open`` (torch tensors), with unreadable files reported as CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as handle:
            yield handle
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"cannot read safetensors file {path!r}: {exc}") from exc


class SafetensorsWeights:
    """Tensors of one or more safetensors files, read lazily in file order (dtype as stored)."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def count(self) -> int:
        """Number of tensors across all files (reads only the headers)."""
        total = 0
        for path in self.files:
            with _open_safetensors(path) as handle:
                total += len(list(handle.keys()))
        return total

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for path in self.files:
            with _open_safetensors(path) as handle:
                for name in handle.keys():
                    yield name, handle.get_tensor(name)
