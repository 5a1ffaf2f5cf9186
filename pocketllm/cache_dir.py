"""PocketLLM's per-user cache directory (built CPU kernels, converted GGUF tokenizers)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$POCKETLLM_CACHE_DIR``, else ``$XDG_CACHE_HOME/pocketllm``, else ``~/.cache/pocketllm``."""
    explicit = os.environ.get("POCKETLLM_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "pocketllm"
