"""Prompt lookup (speculative ``method="ngram"``): propose the tokens that followed the last n-gram earlier on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pocketllm.engine.proposer import Proposer


class NgramProposer(Proposer):
    """Matches the last ``max_n``..``min_n`` tokens (longest first) against the earlier context and proposes up to
    ``k`` tokens that followed the most recent earlier occurrence."""

    def __init__(self, min_n: int, max_n: int, k: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.k = k

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` proposed next tokens of ``tokens`` (empty when no n-gram recurs)."""
        limit = min(self.k, limit)
        length = len(tokens)
        if limit < 1 or length < self.min_n + 1:
            return []
        context = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = context[length - n:]
            # Windows starting at 0..length-n-1: every earlier occurrence, never the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(context[:length - 1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return context[start:start + limit].tolist()
        return []
