"""What requests give back: final outputs, streamed token events, usage and log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the ranked alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    cached_tokens: int = 0
    queue_time_s: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, float | int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "cached_tokens": self.cached_tokens,
            "prefill_time_s": round(self.prefill_time_s, 6),
            "decode_time_s": round(self.decode_time_s, 6),
            "queue_time_s": round(self.queue_time_s, 6),
        }


@dataclass(frozen=True)
class RequestOutput:
    """A finished request. ``finish_reason`` is ``stop``, ``length`` or ``cancelled``."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    metadata: dict = field(default_factory=dict)


@dataclass(frozen=True)
class TokenEvent:
    """One streamed step: the new text (possibly empty while a stop string is held back)."""

    request_id: str
    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] | None = None
    output: RequestOutput | None = None
    """On the last event: the request's complete output."""
