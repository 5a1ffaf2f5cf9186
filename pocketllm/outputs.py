"""What requests give back: final outputs, streamed token events, usage and log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pocketllm.protocol.tool_parsers.base import ToolCall


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
    """A finished request. ``finish_reason`` is ``stop``, ``length``, ``cancelled`` or ``tool_calls``.

    On a chat whose checkpoint writes reasoning or tool calls, ``text`` is the answer alone (stop strings
    applied to it only); ``reasoning_content`` is the reasoning block (None when the model wrote none) and
    ``tool_calls`` the calls parsed from the end of the answer (None unless every call parsed; ``text`` then
    holds only the prose before them).
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    metadata: dict = field(default_factory=dict)
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


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
    reasoning_content: str = ""
    """The new reasoning text of this step (``text`` is the new answer text)."""
    tool_calls: list[ToolCall] | None = None
    """On the last event: the calls parsed from the answer (their text was never sent as ``text``)."""

    def followed_by(self, later: TokenEvent) -> TokenEvent | None:
        """This event and the next one of the same request as one event (texts, tokens and log-probabilities
        joined, the end taken from ``later``); None where one event must stay ahead of the other: this one is
        the last, or ``later`` brings reasoning text after this one's answer text."""
        if self.finished or (self.text and later.reasoning_content):
            return None
        logprobs = self.logprobs if later.logprobs is None else (self.logprobs or []) + later.logprobs
        return TokenEvent(self.request_id, self.text + later.text, self.token_ids + later.token_ids, later.finished,
                          later.finish_reason, later.usage, logprobs, later.output,
                          self.reasoning_content + later.reasoning_content, later.tool_calls)
