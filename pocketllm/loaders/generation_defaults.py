"""A checkpoint's default sampling: its ``generation_config`` values, else PocketLLM's documented defaults.

``pocketllm run`` and ``pocketllm chat`` sample with these unless a flag says otherwise; ``--temperature 0`` is
greedy. The fallback (temperature 0.7, top_p 0.9, no repetition penalty) is measured on the default model by
``scripts/sampling_defaults.py`` (docs/cpu-quality.md): top_p 0.9 cuts the tail that sends a 135M model's answers
astray, and every sampled answer to the README's two prompts ended with EOS inside 128 tokens. A repetition
penalty (1.05, 1.1) made fewer answers loop on list and code prompts but also penalises the prompt's own words:
"What is the capital of France?" then sometimes rambles past 128 tokens instead of naming Paris, and haiku come
out garbled, so it is not part of the fallback.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pocketllm.sampling_params import SamplingParams

# Used when the checkpoint's generation_config sets none of the sampling fields.
FALLBACK_SAMPLING: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9}
# generation_config.json fields that are SamplingParams fields of the same meaning.
_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(generation_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The sampling fields a checkpoint asks for: those its ``generation_config`` sets (temperature, top_p,
    top_k, min_p, repetition_penalty; chosen together by its authors, so the others keep SamplingParams' neutral
    values), else ``FALLBACK_SAMPLING``; ``do_sample: false`` means greedy either way."""
    config = dict(generation_config or {})
    values = {name: config[name] for name in _FIELDS if config.get(name) is not None} or dict(FALLBACK_SAMPLING)
    if config.get("do_sample") is False:   # the checkpoint asks for greedy decoding
        values["temperature"] = 0.0
    return values


def default_sampling_params(generation_config: Mapping[str, Any] | None, **overrides: Any) -> SamplingParams:
    """SamplingParams with the checkpoint's defaults (``sampling_defaults``); ``overrides`` win. An explicit
    ``temperature=0`` is plain greedy decoding: none of the defaults (a top_p, a checkpoint's repetition penalty)
    applies then."""
    if overrides.get("temperature") == 0:
        return SamplingParams(**overrides)
    return SamplingParams(**{**sampling_defaults(generation_config), **overrides})
