"""Converted GGUF tokenizers kept in the user's cache, so that only the first load of a file converts it.

Converting a GGUF file's ``tokenizer.*`` metadata into a fast tokenizer (transformers' converter, which imports
its per-model tokenizer modules) takes about a second on a small CPU; loading the saved result takes a few
hundred milliseconds. An entry is named by the file's absolute path, size and modification time, the versions of
transformers and tokenizers, and ``FORMAT``; a changed file or library gives a new entry, and the oldest entries
beyond ``KEEP`` are removed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pocketllm.cache_dir import cache_root

logger = logging.getLogger("pocketllm.tokenizer")

FORMAT = 1   # bump when what is saved (or the repair applied before saving) changes
KEEP = 16


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def entry_dir(gguf_path: str) -> Path:
    """Where the converted tokenizer of ``gguf_path`` (as it is now) is kept."""
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    key = "\0".join([path, str(stat.st_size), str(stat.st_mtime_ns), _version("transformers"),
                     _version("tokenizers"), str(FORMAT)])
    return cache_root() / "gguf_tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]


def load(gguf_path: str) -> Any | None:
    """The cached HF tokenizer of ``gguf_path``, or None (no entry, or one that does not load)."""
    try:
        directory = entry_dir(gguf_path)
    except OSError:
        return None
    if not (directory / "tokenizer.json").is_file():
        return None
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:   # tokenizers raises a bare Exception for a damaged tokenizer.json
        logger.warning("removing the damaged cached tokenizer in %s: %s", directory, exc)
        shutil.rmtree(directory, ignore_errors=True)
        return None


def store(gguf_path: str, hf_tokenizer: Any) -> None:
    """Save ``hf_tokenizer`` as the entry of ``gguf_path`` (written aside, then renamed into place); a cache that
    cannot be written is skipped with a debug message."""
    try:
        directory = entry_dir(gguf_path)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = directory.with_name(f"{directory.name}.{os.getpid()}.partial")
        hf_tokenizer.save_pretrained(str(staging))
        try:
            os.rename(staging, directory)
        except OSError:   # another process stored it first
            shutil.rmtree(staging, ignore_errors=True)
        _prune(directory.parent)
    except OSError as exc:
        logger.debug("tokenizer cache not written: %s", exc)


def _prune(root: Path) -> None:
    entries = sorted((p for p in root.iterdir() if p.is_dir() and not p.name.endswith(".partial")),
                     key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in entries[KEEP:]:
        shutil.rmtree(stale, ignore_errors=True)
