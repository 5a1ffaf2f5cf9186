"""What every tool-call syntax shares: the OpenAI-shaped call, schema typing, and the streaming hold-back.

Parsing is all-or-nothing: a parser either reads the whole call block at the end of the answer, or reports
nothing and the text stays in ``content`` exactly as generated.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "ParsedToolCalls",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "marker_prefix_start",
    "tool_schemas",
    "typed_value",
]


def new_call_id() -> str:
    """A fresh OpenAI-style call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call the model wrote: ``arguments`` is a JSON object serialized as text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedToolCalls:
    """A successful parse: the prose before the call block (``None`` when blank) and the calls."""

    content: str | None
    calls: tuple[ToolCall, ...]


def marker_prefix_start(text: str, markers: Sequence[str]) -> int:
    """Start of the longest suffix of ``text`` that is a proper prefix of a marker (``len(text)`` if none)."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return len(text) - longest


def back_over_space(text: str, end: int) -> int:
    """Move ``end`` left over the whitespace just before it."""
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return end


# ----------------------------------------------------------------------------------------------------
# Typing text values by the request's own parameter schema
# ----------------------------------------------------------------------------------------------------

_JSON_TYPES = ("null", "boolean", "integer", "number", "string", "object", "array")


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Function name -> its ``parameters`` schema, for the request's function tools."""
    schemas: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            parameters = function.get("parameters")
            schemas.setdefault(function["name"], parameters if isinstance(parameters, Mapping) else {})
    return schemas


def parameter_schema(schemas: Mapping[str, Mapping[str, Any]], function: str, name: str) -> Any:
    """The schema the request declares for one argument of one function (None when it declares none)."""
    properties = schemas.get(function, {}).get("properties")
    return properties.get(name) if isinstance(properties, Mapping) else None


def declared_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: ``type`` (a name or a list), else the branches of anyOf/oneOf, else
    the types of its ``enum``/``const`` values. Unknown type names are ignored."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind} & set(_JSON_TYPES)
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)} & set(_JSON_TYPES)
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        if isinstance(branches, list):
            return set().union(*(declared_types(branch) for branch in branches))
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else (
        [schema["const"]] if "const" in schema else [])
    return {_json_type(value) for value in values} - {None}


def _json_type(value: Any) -> str | None:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    """Strict JSON (NaN and Infinity refused)."""
    return json.loads(text, parse_constant=_refuse_constant)


def typed_value(text: str, schema: Any) -> Any:
    """A value written as bare text, read back against the type its schema declares.

    The text becomes the JSON value it spells when that value's type is one the schema allows (an integral
    number counts as an integer); otherwise, and when the declared type is missing or unknown, the value is
    the characters that were written.
    """
    allowed = declared_types(schema)
    if not allowed or allowed == {"string"}:
        return text
    try:
        value = _loads(text)
    except ValueError:
        return text
    kind = _json_type(value)
    if kind in allowed:
        return value
    if kind == "integer" and "number" in allowed:
        return value
    if kind == "number" and "integer" in allowed and math.isfinite(value) and float(value).is_integer():
        return int(value)
    return text


# ----------------------------------------------------------------------------------------------------
# Parsers and the streaming hold-back
# ----------------------------------------------------------------------------------------------------


class ToolParser:
    """A call syntax: ``opener`` starts the call block; ``parse_block`` reads the block to the end of text."""

    name: ClassVar[str] = ""
    opener: ClassVar[str] = ""

    @property
    def markers(self) -> tuple[str, ...]:
        """Strings that, once seen in the answer, may begin a call block."""
        return (self.opener,)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedToolCalls | None:
        """The calls at the end of ``text`` and the prose before them, or None unless every call parses."""
        start = text.find(self.opener)
        if start < 0:
            return None
        calls = self.parse_block(text[start:], tool_schemas(tools))
        if not calls:
            return None
        prose = text[:start].rstrip()
        return ParsedToolCalls(prose or None, tuple(calls))

    def parse_block(self, block: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
        """Every call of a block that starts with ``opener`` and runs to the end of the text, or None."""
        raise NotImplementedError


class ToolCallStream:
    """Streams the answer while holding back what may be a call block, then parses it all-or-nothing.

    Text is released as it comes until a marker could start; from the first marker on, everything is held
    to the end of generation, where ``finish`` either turns it into calls or releases it as content. The
    whitespace before a marker is held too, so the streamed content equals the non-streamed one.
    """

    def __init__(self, parser: ToolParser, tools: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.parser = parser
        self.tools = tools
        self._shown: list[str] = []  # text released as content
        self._held: list[str] = []  # text held back: a possible marker, or the call block and what follows
        self._holding = False

    @property
    def text(self) -> str:
        """All the answer text pushed so far."""
        return "".join(self._shown) + "".join(self._held)

    def push(self, delta: str) -> str:
        """Add answer text; return the part that is safe to show as content now."""
        if self._holding:
            self._held.append(delta)
            return ""
        buffer = "".join(self._held) + delta
        found = [i for i in (buffer.find(m) for m in self.parser.markers) if i >= 0]
        if found:
            cut = back_over_space(buffer, min(found))
            self._holding = True
        else:
            cut = back_over_space(buffer, marker_prefix_start(buffer, self.parser.markers))
        self._held = [buffer[cut:]] if cut < len(buffer) else []
        self._shown.append(buffer[:cut])
        return buffer[:cut]

    def finish(self, parse: bool = True) -> tuple[str, ParsedToolCalls | None]:
        """End of the answer: (content still to show, the parsed calls or None)."""
        result = self.parser.parse(self.text, self.tools) if parse and self._holding else None
        held, self._held = "".join(self._held), []
        if result is None:
            self._shown.append(held)
            return held, None
        return "", result
