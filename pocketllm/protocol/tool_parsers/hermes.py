"""Hermes-style JSON calls (Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The arguments are JSON already, so they carry their own types and are passed on as written (re-serialized).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pocketllm.protocol.tool_parsers.base import ToolCall, ToolParser

_OPEN = "<tool_call>"
_CLOSE = "</tool_call>"
_SPACE = re.compile(r"\s*")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body, parse_constant=_refuse_constant)
    except ValueError:
        return None
    if not isinstance(value, dict) or not set(value) <= {"name", "arguments"}:
        return None
    name = value.get("name")
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string holding the object
        try:
            arguments = json.loads(arguments, parse_constant=_refuse_constant)
        except ValueError:
            return None
    if not isinstance(name, str) or not name.strip() or not isinstance(arguments, dict):
        return None
    return ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolParser):
    """JSON objects between ``<tool_call>`` tags, one per call."""

    name = "hermes"
    opener = _OPEN

    def parse_block(self, block: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(block):
            if not block.startswith(_OPEN, pos):
                return None
            end = block.find(_CLOSE, pos + len(_OPEN))
            if end < 0:
                return None
            call = _call(block[pos + len(_OPEN):end])
            if call is None:
                return None
            calls.append(call)
            pos = _SPACE.match(block, end + len(_CLOSE)).end()
        return calls or None
