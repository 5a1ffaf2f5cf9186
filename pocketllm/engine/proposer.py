"""What the engine asks of a speculative proposer (prompt lookup, a draft model, the MTP head), at three points of
a step: when the scheduler builds a verify chunk, before the forward pass, and once the step's tokens are known."""

from __future__ import annotations

from pocketllm.engine.request import Request
from pocketllm.step.sampled import SampledToken
from pocketllm.step.scheduled_chunk import ScheduledChunk


class Proposer:
    """Proposes a request's next tokens, or reserves room for proposals that ``fill`` puts in before the step
    runs (a draft model, the MTP head). The base class proposes nothing and has nothing to fill or follow."""

    # Whether ``advance`` needs the step's emitted tokens on the host as soon as the step is launched (the MTP
    # head runs the step's kept positions with the tokens after them).
    reads_emitted_tokens = False

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` proposed tokens following the request's tokens (empty: it decodes one token)."""
        return []

    def fill(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The step's ``chunks`` with every verify chunk's proposals in place, before the forward pass."""
        return chunks

    def advance(self, chunks: list[ScheduledChunk], emitted: list[list[SampledToken]]) -> None:
        """After the step ran ``chunks``, with the tokens each sampling chunk emitted (only called for a proposer
        that ``reads_emitted_tokens``)."""
