"""Prompt lookup (speculative ``method="ngram"``): propose the tokens that followed the last n-gram earlier on."""

from __future__ import annotations

from pocketllm.engine.proposer import Proposer
from pocketllm.engine.request import Request
from pocketllm.step.host_batch import token_slice


class NgramIndex:
    """Where each n-gram (``min_n``..``max_n`` tokens) of a request's tokens last occurred with a token after it,
    brought up to date as tokens are appended: a lookup costs O(``max_n``), not a scan of the context."""

    __slots__ = ("ends", "indexed")

    def __init__(self, min_n: int, max_n: int) -> None:
        # ends[n][ngram] = e: the latest position e with tokens[e - n:e] == ngram (tokens[e] follows it)
        self.ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.indexed = 0    # every n-gram followed by one of the first ``indexed`` tokens is in ``ends``

    def extend(self, request: Request, length: int) -> None:
        """Index the n-grams followed by tokens ``indexed..length-1`` of ``request``."""
        if length <= self.indexed:
            return
        start = max(0, self.indexed - max(self.ends))
        tokens = token_slice(request, start, length)
        for n, ends in self.ends.items():
            first = max(self.indexed, n)    # the first following position to index: tokens[first - n:first]
            if first < length:
                # Later n-grams overwrite earlier equal ones: each keeps its latest end.
                grams = zip(*(tokens[first - n - start + j:length - n - start + j] for j in range(n)))
                ends.update(zip(grams, range(first, length)))
        self.indexed = length


class NgramProposer(Proposer):
    """Matches the last ``max_n``..``min_n`` tokens (longest first) against the earlier context and proposes up to
    ``k`` tokens that followed the most recent earlier occurrence. Each request's ``NgramIndex`` is kept on the
    request (``Request.proposer_state``), so it goes away with the request."""

    pipelines = True

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` proposed next tokens of the request (empty when no n-gram recurs)."""
        return self._lookup(request, min(self.k, limit))

    def propose_after_pending(self, request: Request, limit: int) -> list[int]:
        """Up to ``min(k, limit)`` proposed tokens after the pending one: the match of the last known tokens
        proposes the pending token and the tokens after it; the first is dropped (the step in flight samples
        it), the rest go to a verify chunk that starts with the pending token."""
        return self._lookup(request, min(self.k, limit) + 1)[1:]

    def _lookup(self, request: Request, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the most recent earlier occurrence of the longest recurring tail
        of the request's known tokens."""
        length = request.num_tokens
        if limit < 1 or length < self.min_n + 1:
            return []
        index = request.proposer_state
        if not isinstance(index, NgramIndex) or index.indexed > length:   # (a request's tokens cut back)
            index = request.proposer_state = NgramIndex(self.min_n, self.max_n)
        index.extend(request, length)
        longest = min(self.max_n, length - 1)
        tail = token_slice(request, length - longest, length)
        for n in range(longest, self.min_n - 1, -1):
            end = index.ends[n].get(tuple(tail[longest - n:]))
            if end is not None:
                return token_slice(request, end, min(end + limit, length))
        return []
