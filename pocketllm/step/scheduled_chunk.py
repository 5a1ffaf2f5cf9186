"""One request's share of a step: which of its tokens run, and whether a token is sampled after them."""

from __future__ import annotations

from typing import Any, NamedTuple


class ScheduledChunk(NamedTuple):
    """Tokens ``start:start + num_tokens`` of ``request`` run this step; ``samples``: the chunk reaches the
    end of the request's tokens, so a new token is sampled after it. (A tuple: a step builds one per running
    request, hundreds per step.)

    A verify chunk (speculative decoding) runs the request's last known token followed by ``draft``, the proposed
    tokens (``num_tokens == 1 + len(draft)``), and every one of its positions is scored. ``draft_probs``: the
    distributions the proposals were drawn from (a ``[len(draft), V]`` float64 CPU tensor, a draft model's sampled
    proposals); None: each proposal is a point mass (prompt lookup, a greedy draft)."""

    request: Any        # the engine's Request (the engine sits above this package)
    num_tokens: int
    start: int
    samples: bool
    draft: tuple[int, ...] = ()
    draft_probs: Any = None

    @classmethod
    def of(cls, request: Any, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, num_tokens, start, start + num_tokens == request.num_scheduled_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def last_token_pending(self) -> bool:
        """The chunk's last input is the token the previous step sampled, still only on the device."""
        return self.end - len(self.draft) > self.request.num_tokens
