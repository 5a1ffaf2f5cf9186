"""The harness wire protocol: one JSON object per line in, id-tagged JSON objects per line out.

This module only parses and validates (no engine, no torch); ``service.py`` acts on what it returns.
Every field an op accepts is acted on; anything else is refused with an error naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from pocketllm.sampling_params import SEED_RANGE

__all__ = ["LINE_TOO_LONG", "MAX_LINE_BYTES", "OPS", "SAMPLING_FIELDS", "Op", "ProtocolError", "encode", "error_line",
           "finish_of", "parse_line", "valid_session_id"]

SAMPLING_FIELDS = ("n", "temp", "top_k", "top_p", "repeat_penalty", "seed", "stop")
OPS: dict[str, tuple[str, ...]] = {
    "generate": ("prompt", "session", "diag", *SAMPLING_FIELDS),
    "chat": ("messages", "session", "diag", *SAMPLING_FIELDS),
    "health": (),
    "cancel": (),
    "open": ("session", "messages"),
    "close": ("session",),
    "auth": ("token",),
    "shutdown": (),
}
ID_REQUIRED = frozenset({"generate", "chat", "cancel"})
ROLES = ("system", "user", "assistant")
MAX_ID_CHARS = 128
# The longest request line (a WebSocket message on a host), in bytes, the newline not counted; a longer one is
# answered with LINE_TOO_LONG (id null) and not read.
MAX_LINE_BYTES = 8 << 20
LINE_TOO_LONG = f"the line is longer than {MAX_LINE_BYTES} bytes (8 MiB), the protocol's limit; it was not read"
MAX_STOPS = 16
_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


class ProtocolError(Exception):
    """A line that cannot be served; ``request_id`` is the id to answer with (None when unknown)."""

    def __init__(self, message: str, request_id: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id


@dataclass
class Op:
    """One validated request line."""

    op: str
    id: Any = None
    fields: dict[str, Any] = field(default_factory=dict)

    def get(self, name: str, default: Any = None) -> Any:
        return self.fields.get(name, default)


def encode(obj: dict[str, Any]) -> str:
    """One output line (without the newline), always encodable as UTF-8: a line holding a lone surrogate (a
    request's ``"\\ud800"`` echoed back in its id, say) is written with every non-ASCII character escaped."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def error_line(message: str, request_id: Any = None) -> dict[str, Any]:
    return {"id": request_id, "error": message}


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def valid_session_id(value: Any) -> bool:
    return isinstance(value, str) and bool(_SESSION_ID.fullmatch(value))


def _check_id(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ProtocolError("id must be an integer or a string")
    if isinstance(value, str) and not 0 < len(value) <= MAX_ID_CHARS:
        raise ProtocolError(f"a string id must have 1 to {MAX_ID_CHARS} characters")
    return value


def _integer(name: str, value: Any, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r}")
    return value


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _sampling(fields: dict[str, Any]) -> None:
    """Type and range checks of the sampling fields (SamplingParams checks them again when built)."""
    if "n" in fields:
        n = _integer("n", fields["n"])
        if n == 0 or n < -1:
            raise ValueError(f"n must be a positive token budget, or -1 for 'until the context is full'; got {n}")
    if "temp" in fields and _number("temp", fields["temp"]) < 0:
        raise ValueError("temp must be >= 0 (0 is greedy)")
    if "top_k" in fields:
        _integer("top_k", fields["top_k"], low=0)
    if "top_p" in fields and not 0 < _number("top_p", fields["top_p"]) <= 1:
        raise ValueError("top_p must be in (0, 1]")
    if "repeat_penalty" in fields and not _number("repeat_penalty", fields["repeat_penalty"]) > 0:
        raise ValueError("repeat_penalty must be > 0 (1 is off)")
    if "seed" in fields:
        seed = _integer("seed", fields["seed"])
        if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
            raise ValueError(f"seed must fit in 64 bits ({SEED_RANGE[0]} to {SEED_RANGE[1]}), got {seed}")
    if "stop" in fields:
        stop = fields["stop"]
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if len(stops) > MAX_STOPS:
            raise ValueError(f"stop takes at most {MAX_STOPS} strings")
        for stop_string in stops:
            _unicode("stop", stop_string)
        fields["stop"] = tuple(stops)


def _unicode(name: str, text: str) -> str:
    """``text`` unchanged if it is valid Unicode (no lone surrogate, which no tokenizer can encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{name} is not valid Unicode (it holds a lone surrogate)") from None
    return text


def check_messages(messages: Any, name: str = "messages") -> list[dict[str, str]]:
    """A non-empty list of {"role": system|user|assistant, "content": str}; returns fresh copies."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{name} must be a non-empty list of {{\"role\", \"content\"}} objects")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"{name}[{i}] must be an object")
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ValueError(f"{name}[{i}] has unknown field(s) {', '.join(map(repr, extra))} "
                             "(a message has only 'role' and 'content')")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{name}[{i}].role must be one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"{name}[{i}].content must be a string")
        _unicode(f"{name}[{i}].content", content)
        clean.append({"role": role, "content": content})
    return clean


def _validate(op: str, fields: dict[str, Any]) -> None:
    if "session" in fields and not valid_session_id(fields["session"]):
        raise ValueError("session must be 1 to 64 letters, digits, '_' or '-', starting with a letter or digit")
    if "diag" in fields and not isinstance(fields["diag"], bool):
        raise ValueError("diag must be true or false")
    if op == "generate":
        if not isinstance(fields.get("prompt"), str) or not fields["prompt"]:
            raise ValueError("generate needs a non-empty string 'prompt'")
        _unicode("prompt", fields["prompt"])
    elif op == "chat":
        if "messages" not in fields:
            raise ValueError("chat needs 'messages'")
        fields["messages"] = check_messages(fields["messages"])
    elif op == "open":
        if "messages" in fields:
            fields["messages"] = check_messages(fields["messages"])
    elif op == "close":
        if "session" not in fields:
            raise ValueError("close needs the 'session' to close")
    elif op == "auth":
        if not isinstance(fields.get("token"), str):
            raise ValueError("auth needs a string 'token'")
    _sampling(fields)


def parse_line(line: str | bytes) -> Op:
    """Validate one request line; raises ``ProtocolError`` (with the id to answer, if any). A line read as bytes
    (both faces read bytes) longer than ``MAX_LINE_BYTES`` is refused unread."""
    if isinstance(line, (bytes, bytearray)):
        if len(line) > MAX_LINE_BYTES:
            raise ProtocolError(LINE_TOO_LONG)
        try:
            line = bytes(line).decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("the line is not valid UTF-8") from None
    try:
        obj = json.loads(line, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"the line is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("each line must be a JSON object like {\"op\": \"generate\", \"id\": 1, ...}")
    request_id = None
    if "id" in obj:
        request_id = _check_id(obj["id"])
    op = obj.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {op!r}; the ops are {', '.join(OPS)}", request_id)
    if op in ID_REQUIRED and request_id is None:
        what = "the request to cancel" if op == "cancel" else "this request and its answers"
        raise ProtocolError(f"{op} needs an 'id' naming {what}")
    allowed = OPS[op]
    unknown = sorted(set(obj) - {"op", "id", *allowed})
    if unknown:
        accepted = ", ".join(allowed) if allowed else "no fields besides op and id"
        raise ProtocolError(f"unknown field(s) {', '.join(map(repr, unknown))} for op {op!r} (it takes: {accepted})",
                            request_id)
    fields = {name: obj[name] for name in allowed if name in obj}
    try:
        _validate(op, fields)
    except ValueError as exc:
        raise ProtocolError(str(exc), request_id) from None
    return Op(op, request_id, fields)


def finish_of(reason: str | None, stop_reason: Any) -> str:
    """Engine finish reason → the protocol's: eos | budget | stop | cancel."""
    if reason == "length":
        return "budget"
    if reason in ("cancelled", "cancel", "abort"):
        return "cancel"
    if reason == "stop" and isinstance(stop_reason, str):
        return "stop"
    return "eos"
