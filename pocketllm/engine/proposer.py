"""What the engine asks of a speculative proposer (prompt lookup, a draft model, the MTP head), at three points of
a step: when the scheduler builds a verify chunk, before the forward pass, and once the step's tokens are known."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pocketllm.engine.request import Request
from pocketllm.step.sampled import SampledToken
from pocketllm.step.scheduled_chunk import ScheduledChunk


class Proposer:
    """Proposes a request's next tokens, or reserves room for proposals that ``fill`` puts in before the step
    runs (a draft model, the MTP head). The base class proposes nothing and has nothing to fill or follow."""

    # Whether ``advance`` needs the step's emitted tokens on the host as soon as the step is launched (the MTP
    # head runs the step's kept positions with the tokens after them).
    reads_emitted_tokens = False
    # Whether the engine may schedule a step while the one before it runs (``propose_after_pending``); a proposer
    # that runs a model of its own over every step's chunks (a draft model, the MTP head) needs each step's
    # tokens first.
    pipelines = False

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` proposed tokens following the request's tokens (empty: it decodes one token)."""
        return []

    def propose_after_pending(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` proposed tokens to follow the token the request's step in flight is sampling (not yet
        on the host): guesses, which the verify step keeps only where the model agrees."""
        return []

    def fill(self, chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
        """The step's ``chunks`` with every verify chunk's proposals in place, before the forward pass."""
        return chunks

    def advance(self, chunks: list[ScheduledChunk], emitted: list[list[SampledToken]]) -> None:
        """After the step ran ``chunks``, with the tokens each sampling chunk emitted (only called for a proposer
        that ``reads_emitted_tokens``)."""


def chains_on_device(requests: Sequence[Request]) -> bool:
    """Whether these requests' proposals can chain on the device (``greedy_chain``): every one greedy, with no
    penalty that reads the proposals made before it on the host."""
    return all(r.params.greedy and not r.params.needs_penalties for r in requests)


def greedy_chain(first: torch.Tensor, wanted: Sequence[int],
                 forward: Callable[[torch.Tensor, list[tuple[int, int]], int], torch.Tensor]) -> list[list[int]]:
    """Greedy proposals made forward after forward without waiting for any on the host: ``first`` holds each
    request's first proposal (argmax ids on the device), request ``i`` wants ``wanted[i]``. ``forward(tokens,
    active, depth)`` runs the drafter once more for ``active``, (row of ``tokens``, request) pairs whose latest
    proposal is that row, and returns their next argmax ids, still on the device. All are read back at the end."""
    drawn = [first]
    drawn_by = [list(range(len(wanted)))]      # the request of each row of each forward's ids
    tokens = first
    for depth in range(1, max(wanted, default=0)):
        active = [(row, i) for row, i in enumerate(drawn_by[-1]) if wanted[i] > depth]
        tokens = forward(tokens, active, depth)
        drawn.append(tokens)
        drawn_by.append([i for _, i in active])
    proposals: list[list[int]] = [[] for _ in wanted]
    for i, token in zip((i for rows in drawn_by for i in rows), torch.cat(drawn).tolist()):
        proposals[i].append(token)
    return proposals
