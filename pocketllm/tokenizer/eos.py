"""End-of-sequence ids: which tokens end generation, and where that answer came from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pocketllm.errors import InvalidRequestError


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _override_ids(value: Any) -> frozenset[int]:
    """A caller's ``eos_token_id``: an int or a non-empty list of ints, nothing else."""
    if _is_int(value):
        return frozenset([value])
    if isinstance(value, (list, tuple)) and value and all(_is_int(item) for item in value):
        return frozenset(value)
    raise InvalidRequestError(
        f"backend_options['eos_token_id'] must be an integer or a list of integers, got {value!r}",
        param="eos_token_id")


def _checkpoint_ids(value: Any) -> frozenset[int]:
    """Ids from a checkpoint file's ``eos_token_id`` (int or list); empty when absent or malformed."""
    if _is_int(value):
        return frozenset([value])
    if isinstance(value, (list, tuple)):
        return frozenset(item for item in value if _is_int(item))
    return frozenset()


def resolve_eos(backend_options: Mapping, generation_config: dict, hf_config: Any,
                tokenizer: Any) -> tuple[frozenset[int], str]:
    """``(eos ids, source)``: backend_options, then generation_config.json, config.json, the tokenizer."""
    if "eos_token_id" in backend_options:
        return _override_ids(backend_options["eos_token_id"]), "backend_options"
    candidates = (
        ("generation_config", (generation_config or {}).get("eos_token_id")),
        ("config", getattr(hf_config, "eos_token_id", None) if hf_config is not None else None),
        ("tokenizer", getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None),
    )
    for source, value in candidates:
        ids = _checkpoint_ids(value)
        if ids:
            return ids, source
    return frozenset(), "none"
