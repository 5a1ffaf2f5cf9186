"""Incremental detokenisation that stays right at BPE and UTF-8 boundaries."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer"]

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded in front of the answer, so its first token is rendered in context.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas by decoding a short window of the cumulative sequence.

    The window starts at ``prefix_offset``; ``read_offset`` marks where the text already emitted ends. A
    delta is released only when the window's text grew and does not end in U+FFFD, so a character whose
    UTF-8 bytes span several tokens is emitted whole, once its last byte has arrived.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], prompt_token_ids: Sequence[int] = ()) -> None:
        """``decode`` maps ids to text (e.g. ``tokenizer.decode`` skipping special tokens)."""
        self._decode = decode
        self._ids: list[int] = self._prompt_context(list(prompt_token_ids))
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _prompt_context(self, prompt: list[int]) -> list[int]:
        """The last few prompt ids, unless they end inside a character (then no context at all)."""
        context = prompt[-PROMPT_CONTEXT_TOKENS:]
        return [] if self._decode(context).endswith(REPLACEMENT_CHAR) else context

    def _window_delta(self, final: bool) -> str:
        """Text gained past ``read_offset``; empty while it may end in an incomplete character."""
        window = self._ids[self._prefix_offset:]
        emitted = self._decode(window[: self._read_offset - self._prefix_offset])
        current = self._decode(window)
        if len(current) <= len(emitted) or (current.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if not current.startswith(emitted):
            # A decoder that rewrites earlier text (e.g. clean-up of spaces): never drop the new characters.
            return current[len(os.path.commonprefix([emitted, current])):]
        return current[len(emitted):]

    def push(self, token_ids: Sequence[int]) -> str:
        """Append generated ids and return the new text they complete (possibly empty)."""
        if not token_ids:
            return ""
        self._ids.extend(token_ids)
        delta = self._window_delta(final=False)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held (an incomplete character renders as U+FFFD)."""
        delta = self._window_delta(final=True)
        self.text += delta
        return delta
