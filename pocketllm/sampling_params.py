"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pocketllm.errors import InvalidRequestError

MAX_LOGPROBS = 20


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


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it ends.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``logprobs`` is ``None`` for
    none, otherwise the number of alternatives (0..20) ranked from raw logits beside the sampled token.
    ``stop`` strings are matched on the decoded text by the front end; ``stop_token_ids`` end the
    request in the engine like EOS does.
    """

    max_tokens: int = 256
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

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, low=1)
        _number("temperature", self.temperature, low=0.0)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        top_k = _integer("top_k", self.top_k, low=-1)
        object.__setattr__(self, "top_k", 0 if top_k == -1 else top_k)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        if self.seed is not None:
            _integer("seed", self.seed)
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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)
