"""Command-line flags generated from ``EngineArgs`` and ``SamplingParams`` (one source for each)."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable
from typing import Any

from pocketllm.config import EngineArgs, field_kind, parse_field
from pocketllm.sampling_params import SamplingParams

SAMPLING_FLAGS = {
    "max_tokens": (int, "Most tokens to generate."),
    "temperature": (float, "Sampling temperature (0 = greedy)."),
    "top_p": (float, "Nucleus sampling mass."),
    "top_k": (int, "Sample among the k most likely tokens (0 = off)."),
    "min_p": (float, "Drop tokens below min_p times the top probability."),
    "repetition_penalty": (float, "Penalise tokens already in the prompt or output (1 = off)."),
    "frequency_penalty": (float, "Penalise tokens by how often they were generated."),
    "presence_penalty": (float, "Penalise tokens that were generated at all."),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    """``parse`` under ``name``, which argparse's error for a bad value shows ("invalid int value: 'x'")."""
    def typed(raw: str) -> Any:
        return parse(raw)
    typed.__name__ = name
    return typed


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineArgs):
        kind = field_kind(f.name)
        help_text = f.metadata.get("help", "")
        flags = ("-m", _flag(f.name)) if f.name == "model" else (_flag(f.name),)
        if kind is bool:
            group.add_argument(*flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(*flags, dest=f.name, default=None, metavar=kind.__name__.upper(),
                               type=_typed(functools.partial(parse_field, f.name), kind.__name__), help=help_text)


def engine_args_from(namespace: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the environment (POCKETLLM_*), overridden by flags given on the command line."""
    given = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(EngineArgs)
             if getattr(namespace, f.name, None) is not None}
    return EngineArgs.from_env(**given)


def add_sampling_flags(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    group = parser.add_argument_group("sampling")
    for name, (kind, help_text) in SAMPLING_FLAGS.items():
        group.add_argument(_flag(name), dest=name, type=kind, default=defaults.get(name),
                           help=f"{help_text} (default: {defaults.get(name, 'the library default')})")
    group.add_argument("--stop", action="append", default=None, help="A stop string (repeatable).")
    group.add_argument("--ignore-eos", action="store_true", help="Keep generating past end-of-sequence.")
    group.add_argument("--logit-bias", type=_typed(json.loads, "JSON"), default=None,
                       help='Token-id → bias map as JSON, e.g. {"42": -100}.')


def sampling_params_from(namespace: argparse.Namespace) -> SamplingParams:
    values = {name: getattr(namespace, name) for name in SAMPLING_FLAGS if getattr(namespace, name) is not None}
    if namespace.stop:
        values["stop"] = tuple(namespace.stop)
    if namespace.ignore_eos:
        values["ignore_eos"] = True
    if namespace.logit_bias:
        values["logit_bias"] = namespace.logit_bias
    return SamplingParams(**values)
