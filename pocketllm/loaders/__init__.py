"""Checkpoint loading: GGUF files, Hugging Face safetensors directories and dummy presets."""

from pocketllm.loaders.checkpoint import Checkpoint, load_checkpoint
from pocketllm.loaders.default_model import default_model_path
from pocketllm.loaders.dummy import preset_names

__all__ = ["Checkpoint", "load_checkpoint", "default_model_path", "preset_names"]
