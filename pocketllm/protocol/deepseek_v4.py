"""Our encoder of DeepSeek-V4's documented prompt format, for checkpoints that ship no chat template.

The layout follows ``spec/deepseek-v4-encoding.md``: BOS, the system text (with a "## Tools" section and a
response-format section when asked), ``<｜User｜>`` turns (tool results merged into user turns as
``<tool_result>`` blocks, ordered like the calls they answer), assistant turns as
``[reasoning</think>]content[DSML calls]<｜end▁of▁sentence｜>``, and after the last user turn
``<｜Assistant｜>`` followed by ``<think>`` (thinking mode) or ``</think>`` (chat mode). The prose of the tools
section and of the maximum-effort paragraph is our own wording of what the notes describe.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_template import normalize_messages
from pocketllm.protocol.tool_parsers.dsml import (
    ASSISTANT,
    BOS,
    DSML,
    EOS,
    THINK_END,
    THINK_START,
    USER,
    is_deepseek_v4,
    render_dsml_calls,
)

__all__ = ["REASONING_EFFORTS", "THINKING_MODES", "encode_messages", "is_deepseek_v4"]

THINKING_MODES = ("chat", "thinking")
REASONING_EFFORTS = ("high", "max")

TOOLS_SECTION = f"""## Tools

You can call the functions described below. To call one or more of them, finish your reply with a block \
written exactly like this:

<{DSML}tool_calls>
<{DSML}invoke name="FUNCTION_NAME">
<{DSML}parameter name="PARAMETER_NAME" string="true|false">VALUE</{DSML}parameter>
...
</{DSML}invoke>
...
</{DSML}tool_calls>

Write a string parameter as is, with string="true"; write a parameter of any other type as JSON, with \
string="false". In thinking mode, reason inside {THINK_START}...{THINK_END} before you write the calls.

### Available Tool Schemas

"""

RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n"

MAX_EFFORT_PARAGRAPH = (
    "Reasoning effort: maximum. Reason as thoroughly as the task allows: consider every approach, check each "
    "step and each assumption, and verify the result before you give the final answer.\n\n")


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _tools_text(tools: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, Mapping) else tool
        lines.append(_dumps(function))
    return TOOLS_SECTION + "\n".join(lines)


def _schema_of(response_format: Mapping[str, Any]) -> Any:
    kind = response_format.get("type")
    if kind == "json_schema":
        spec = response_format.get("json_schema") or {}
        return spec.get("schema", {}) if isinstance(spec, Mapping) else {}
    if kind == "json_object":
        return {"type": "object"}
    return None


def _sections(message: Mapping[str, Any]) -> str:
    text = ""
    if message.get("tools"):
        text += "\n\n" + _tools_text(message["tools"])
    if message.get("response_format") is not None:
        schema = _schema_of(message["response_format"])
        if schema is not None:
            text += "\n\n" + RESPONSE_FORMAT_SECTION + _dumps(schema)
    return text


def _content(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    return content if isinstance(content, str) else ""


def _reasoning(message: Mapping[str, Any]) -> str:
    reasoning = message.get("reasoning_content")
    return reasoning if isinstance(reasoning, str) else ""


def _tool_results(messages: list[dict], start: int) -> tuple[str, int]:
    """The user-turn text of the tool messages from ``start`` on, and the index after them."""
    end = start
    while end < len(messages) and messages[end]["role"] == "tool":
        end += 1
    order: dict[str, int] = {}
    for previous in reversed(messages[:start]):
        if previous["role"] == "assistant":
            for position, call in enumerate(previous.get("tool_calls") or []):
                if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                    order.setdefault(call["id"], position)
            break
    group = sorted(messages[start:end], key=lambda m: order.get(m.get("tool_call_id"), len(order)))
    return "\n\n".join(f"<tool_result>{_content(m)}</tool_result>" for m in group), end


def encode_messages(messages: Sequence[Mapping[str, Any]], *, thinking_mode: str = "chat",
                    drop_thinking: bool = True, reasoning_effort: str | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    response_format: Mapping[str, Any] | None = None,
                    add_bos: bool = True, add_generation_prompt: bool = True) -> str:
    """The DeepSeek-V4 prompt for ``messages`` (the caller's objects are never modified).

    ``tools`` and ``response_format`` (request-level) are attached to the first system message, which is
    created empty when the conversation has none; a message may also carry its own ``tools`` /
    ``response_format``.
    """
    if thinking_mode not in THINKING_MODES:
        raise InvalidRequestError(f"thinking_mode must be one of {', '.join(THINKING_MODES)}",
                                  param="thinking_mode")
    if reasoning_effort is not None and reasoning_effort not in REASONING_EFFORTS:
        raise InvalidRequestError(
            f"reasoning_effort={reasoning_effort!r} is not understood by DeepSeek-V4's prompt format, which "
            f"knows {' and '.join(REASONING_EFFORTS)}; send one of those or omit it", param="reasoning_effort")
    msgs = normalize_messages(messages)
    if tools or response_format is not None:
        if msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": ""})
        if tools:
            msgs[0]["tools"] = [dict(t) for t in tools]
        if response_format is not None:
            msgs[0]["response_format"] = dict(response_format)
    thinking = thinking_mode == "thinking"
    if any(m.get("tools") for m in msgs):
        drop_thinking = False
    last_user = max((i for i, m in enumerate(msgs) if m["role"] in ("user", "developer")), default=-1)
    if thinking and reasoning_effort == "max":
        msgs[0]["content"] = MAX_EFFORT_PARAGRAPH + _content(msgs[0])

    def opener(after: int) -> str:
        """The assistant opener after the turn ending at message ``after``."""
        keeps_reasoning = thinking and (not drop_thinking or after >= last_user)
        return ASSISTANT + (THINK_START if keeps_reasoning else THINK_END)

    parts = [BOS] if add_bos else []
    opened: str | None = None  # the opener written before the assistant turn that comes next
    i = 0
    while i < len(msgs):
        message = msgs[i]
        role = message["role"]
        if role == "system":
            parts.append(_content(message) + _sections(message))
            i += 1
            continue
        if role == "assistant":
            if opened is None:
                opened = opener(i - 1)
                parts.append(opened)
            if opened.endswith(THINK_START):
                parts.append(_reasoning(message) + THINK_END)
            parts.append(_content(message))
            if message.get("tool_calls"):
                try:
                    parts.append("\n\n" + render_dsml_calls(message["tool_calls"]))
                except ValueError as exc:
                    raise InvalidRequestError(f"an assistant tool call cannot be encoded: {exc}",
                                              param="messages") from exc
            parts.append(EOS)
            opened = None
            i += 1
            continue
        if role == "tool":
            text, i = _tool_results(msgs, i)
            parts.append(USER + text)
        else:  # user, developer
            sections = _sections(message) if role == "developer" else ""
            parts.append(USER + _content(message) + sections)
            i += 1
        following = msgs[i]["role"] if i < len(msgs) else None
        if following == "assistant" or (following is None and add_generation_prompt):
            opened = opener(i - 1)
            parts.append(opened)
        else:
            opened = None
    return "".join(parts)
