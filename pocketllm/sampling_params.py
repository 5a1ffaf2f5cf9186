"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pocketllm.errors import InvalidRequestError

MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**64 - 1)   # what a 64-bit generator seed holds


def _number(name: str, value: Any, low: float | None = None, high: float | None = None,
            low_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    if low is not None and (value < low or (low_open and value == low)):
        bound = f"> {low}" if low_open else f">= {low}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value!r}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value!r}", param=name)
    return float(value)


def _integer(name: str, value: Any, low: int | None = None, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value!r}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value!r}", param=name)
    return value


@lru_cache(maxsize=256)
def _grammar_error(schema: str | None) -> str | None:
    """Why xgrammar cannot turn ``schema`` (JSON text; None: any JSON object) into a grammar.

    Returns None when it can, or when xgrammar is not installed (the engine then refuses the request,
    since it declares no structured outputs).
    """
    try:
        import xgrammar
    except ImportError:
        return None
    try:
        xgrammar.Grammar.from_json_schema(schema or '{"type": "object"}', any_whitespace=False,
                                          strict_mode=schema is not None)
    except Exception as exc:  # xgrammar reports every schema problem as a RuntimeError/ValueError
        lines = [line for line in str(exc).strip().splitlines() if line.strip()]
        # Drop xgrammar's "[time] source.cc:line:" prefix; keep the reason.
        return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(exc).__name__
    return None


@dataclass(frozen=True)
class StructuredOutput:
    """A grammar the answer is constrained to, token by token.

    ``json_schema``: a JSON Schema (a mapping, or its JSON text) the answer must validate against; it is kept
    as compact JSON text (key order kept), which is also the key compiled grammars are cached under.
    ``json_object``: any JSON object. Exactly one of the two is set. ``strict`` records OpenAI's flag; the
    grammar is always strict (it never produces a property the schema does not allow). ``param`` names
    the request field a bad schema is reported against.

    ``reasoning`` (a thinking model's ``(start, end)`` markers, each one token, e.g. ``<think>`` and
    ``</think>``): the grammar starts after the reasoning block. With ``in_reasoning`` the prompt opened the
    block, so the output is free until the end marker; without it the model may open the block as its first
    token, or start the answer at once.
    """

    json_schema: Any = None
    json_object: bool = False
    strict: bool | None = None
    param: str = field(default="response_format", compare=False)
    reasoning: tuple[str, str] | None = None
    in_reasoning: bool = False

    def __post_init__(self) -> None:
        param = self.param
        if not isinstance(self.json_object, bool):
            raise InvalidRequestError("json_object must be a boolean", param=param)
        if self.strict is not None and not isinstance(self.strict, bool):
            raise InvalidRequestError("strict must be a boolean", param=param)
        if self.reasoning is not None:
            if (not isinstance(self.reasoning, (tuple, list)) or len(self.reasoning) != 2
                    or not all(isinstance(m, str) and m for m in self.reasoning)):
                raise InvalidRequestError("reasoning must be a (start, end) pair of marker strings", param=param)
            object.__setattr__(self, "reasoning", tuple(self.reasoning))
        if not isinstance(self.in_reasoning, bool) or (self.in_reasoning and self.reasoning is None):
            raise InvalidRequestError("in_reasoning is a boolean and needs the reasoning markers", param=param)
        schema = self.json_schema
        if (schema is None) == (not self.json_object):
            raise InvalidRequestError("a structured output is either a json_schema or json_object=True "
                                      "(exactly one of them)", param=param)
        if schema is not None:
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}", param=param) from None
            if not isinstance(schema, Mapping):
                raise InvalidRequestError(f"a JSON schema must be a JSON object, got {type(schema).__name__}",
                                          param=param)
            try:
                # Key order is kept: properties are generated in the order the schema declares them.
                text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"the JSON schema is not plain JSON: {exc}", param=param) from None
            object.__setattr__(self, "json_schema", text)
        error = _grammar_error(self.json_schema)
        if error is not None:
            raise InvalidRequestError(f"the JSON schema cannot be turned into a grammar: {error}", param=param)

    @property
    def kind(self) -> str:
        """``json_schema`` or ``json_object``."""
        return "json_object" if self.json_object else "json_schema"

    @property
    def schema(self) -> dict | None:
        """The JSON schema as a dict (None for json_object)."""
        return None if self.json_schema is None else json.loads(self.json_schema)


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it ends.

    ``max_tokens`` None (the default) lets a request generate up to the end of the context.
    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``logprobs`` is ``None`` for
    none, otherwise the number of alternatives (0..20) ranked from raw logits beside the sampled token.
    ``stop`` strings are matched on the decoded text by the front end; ``stop_token_ids`` end the
    request in the engine like EOS does. ``structured_output`` constrains the answer to a grammar (a JSON
    schema or any JSON object); each request gets its own matcher, and EOS is allowed only once the
    grammar is complete.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0.0)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        top_k = _integer("top_k", self.top_k, low=-1)
        object.__setattr__(self, "top_k", 0 if top_k == -1 else top_k)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _integer("seed", self.seed, *SEED_RANGE)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}",
                                      param="stop")
        object.__setattr__(self, "stop", tuple(s for s in stop if s))
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple)):
            raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
        object.__setattr__(self, "stop_token_ids",
                           tuple(_integer("stop_token_ids", i, low=0) for i in ids))
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos must be a boolean", param="ignore_eos")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        bias = self.logit_bias or {}
        if not isinstance(bias, dict):
            raise InvalidRequestError("logit_bias must map token ids to numbers", param="logit_bias")
        clean: dict[int, float] = {}
        for key, value in bias.items():
            try:
                token = int(key)
            except (TypeError, ValueError):
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id",
                                          param="logit_bias") from None
            if token < 0:
                raise InvalidRequestError(f"logit_bias key {key!r} is not a token id", param="logit_bias")
            clean[token] = _number("logit_bias", value, low=-100.0, high=100.0)
        object.__setattr__(self, "logit_bias", clean)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise InvalidRequestError("structured_output must be a StructuredOutput",
                                          param="structured_output")
            if self.ignore_eos:
                raise InvalidRequestError(
                    "ignore_eos cannot be combined with a structured output: a constrained answer ends with EOS "
                    "once its grammar is complete", param="ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)
