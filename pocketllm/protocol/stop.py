"""Stop strings matched on decoded text, with the streaming hold-back of partial matches."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["StopMatcher", "find_stop", "truncate_at_stop"]


def _clean(stops: Sequence[str]) -> tuple[str, ...]:
    """Drop empty strings and duplicates, keeping order."""
    return tuple(dict.fromkeys(s for s in stops if s))


def find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop occurrence in ``text`` as (start, stop); at one start the shortest stop wins."""
    best: tuple[int, int, str] | None = None
    for stop in _clean(stops):
        start = text.find(stop)
        if start >= 0 and (best is None or (start, len(stop)) < best[:2]):
            best = (start, len(stop), stop)
    return None if best is None else (best[0], best[2])


def truncate_at_stop(text: str, stops: Sequence[str]) -> str:
    """Non-streaming rule: cut ``text`` at the earliest occurrence of any stop (the stop itself dropped)."""
    found = find_stop(text, stops)
    return text if found is None else text[: found[0]]


def _partial_start(text: str, stops: Sequence[str]) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of a stop (``len(text)`` if none)."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return len(text) - longest


class StopMatcher:
    """Streaming stop matcher: the emitted pieces plus ``flush()`` equal ``truncate_at_stop(text)``."""

    def __init__(self, stops: Sequence[str]) -> None:
        """Prepare for ``stops`` (empty strings are ignored)."""
        self.stops = _clean(stops)
        self.matched: str | None = None
        self._held = ""

    @property
    def stopped(self) -> bool:
        """Whether a stop string has ended the text."""
        return self.matched is not None

    @property
    def held(self) -> str:
        """Text withheld because it may be the start of a stop string (shorter than the longest stop)."""
        return self._held

    def push(self, delta: str) -> tuple[str, bool]:
        """Add new text; return (text safe to emit now, stopped?)."""
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        found = find_stop(text, self.stops)
        partial = _partial_start(text, self.stops)
        if found is not None and found[0] <= partial:
            # No stop starting earlier can still complete: this is the earliest occurrence in the full text.
            self.matched = found[1]
            self._held = ""
            return text[: found[0]], True
        # Positions before `partial` (and before any complete match) can never start a stop: emit them.
        self._held = text[partial:]
        return text[:partial], False

    def flush(self) -> str:
        """End of generation: release the held tail, cut at a stop that completed inside it."""
        if self.matched is not None:
            return ""
        text, self._held = self._held, ""
        found = find_stop(text, self.stops)
        if found is None:
            return text
        self.matched = found[1]
        return text[: found[0]]
