"""Parsed tool calls as OpenAI streams them: per call a header (index, id, type, name), then argument fragments.

Calls are parsed all or nothing at the end of an answer, so a stream sends them only once they parse; they are
then sent in OpenAI's streamed form, which clients accumulate by ``index``: the first delta of a call carries its
``id``, ``type`` and function ``name`` with empty ``arguments``, and the deltas after it carry pieces of the
arguments text, cut after each top-level member of the JSON object (their concatenation is the arguments).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["argument_fragments", "tool_call_deltas"]


def argument_fragments(arguments: str) -> list[str]:
    """``arguments`` cut after each comma between top-level members; the pieces join back to ``arguments``."""
    pieces: list[str] = []
    start, depth, in_string, escaped = 0, 0, False, False
    for i, char in enumerate(arguments):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == "," and depth == 1:
            end = i + 1
            while end < len(arguments) and arguments[end] == " ":
                end += 1
            pieces.append(arguments[start:end])
            start = end
    if start < len(arguments) or not pieces:
        pieces.append(arguments[start:])
    return pieces


def tool_call_deltas(calls: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The ``delta.tool_calls`` entries that stream OpenAI-shaped ``calls``, one entry per chunk, in order."""
    entries: list[dict[str, Any]] = []
    for index, call in enumerate(calls):
        function = call["function"]
        entries.append({"index": index, "id": call["id"], "type": "function",
                        "function": {"name": function["name"], "arguments": ""}})
        entries.extend({"index": index, "function": {"arguments": piece}}
                       for piece in argument_fragments(function["arguments"]) if piece)
    return entries
