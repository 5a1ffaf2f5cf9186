"""What the scheduler asks of a speculative proposer (prompt lookup, a draft model)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Proposes a request's next tokens, or reserves room for proposals a later call fills in (a draft model)."""

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``limit`` proposed tokens following ``tokens`` (empty: the request decodes one token)."""
