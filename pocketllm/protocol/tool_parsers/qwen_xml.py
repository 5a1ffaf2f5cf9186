"""Qwen3.5 / Qwen3-Coder XML calls.

``<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function></tool_call>``, one block per call.

The syntax records no types, so each value is read back against the type the request's own
``parameters.properties`` declares (``typed_value``). The template writes a value between newlines
(``<parameter=x>\\nVALUE\\n</parameter>``); one newline on each side belongs to the layout, not the value.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from pocketllm.protocol.tool_parsers.base import ToolCall, ToolParser, parameter_schema, typed_value

_CALL_OPEN = re.compile(r"<tool_call>\s*<function=([^<>\n]+)>")
_PARAM_OPEN = re.compile(r"\s*<parameter=([^<>\n]+)>")
_PARAM_CLOSE = "</parameter>"
_CALL_CLOSE = re.compile(r"\s*</function>\s*</tool_call>")
_SPACE = re.compile(r"\s*")


def _unwrap(value: str) -> str:
    """Drop the one newline the template puts on each side of a value."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


class QwenXmlToolParser(ToolParser):
    """Qwen's XML function-call syntax (qwen3_5, qwen3_5_text, Qwen3-Coder)."""

    name = "qwen_xml"
    opener = "<tool_call>"

    def parse_block(self, block: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while pos < len(block):
            opened = _CALL_OPEN.match(block, pos)
            if opened is None:
                return None
            function = opened.group(1).strip()
            if not function:
                return None
            pos = opened.end()
            arguments: dict[str, Any] = {}
            while True:
                closed = _CALL_CLOSE.match(block, pos)
                if closed is not None:
                    pos = closed.end()
                    break
                param = _PARAM_OPEN.match(block, pos)
                if param is None:
                    return None
                name = param.group(1).strip()
                end = block.find(_PARAM_CLOSE, param.end())
                if not name or name in arguments or end < 0:
                    return None
                raw = _unwrap(block[param.end():end])
                if "<parameter=" in raw or "<tool_call>" in raw:
                    return None  # an unclosed parameter swallowed the next tag
                arguments[name] = typed_value(raw, parameter_schema(schemas, function, name))
                pos = end + len(_PARAM_CLOSE)
            calls.append(ToolCall(function, json.dumps(arguments, ensure_ascii=False)))
            pos = _SPACE.match(block, pos).end()
        return calls or None
