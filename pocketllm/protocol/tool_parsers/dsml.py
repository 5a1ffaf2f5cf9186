"""DeepSeek-V4 DSML calls (format notes: ``spec/deepseek-v4-encoding.md``), read and written.

A block follows the answer after a blank line::

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``string="true"`` values are raw text (they become JSON strings); ``string="false"`` values are JSON text
inserted into ``arguments`` unchanged. A duplicate parameter, a tag not followed by its newline, text after
the block, or a special string inside the content or a value is a format error: nothing is parsed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from pocketllm.protocol.tool_parsers.base import ParsedToolCalls, ToolCall, ToolParser

DSML = "｜DSML｜"
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START, THINK_END = "<think>", "</think>"
TASK_TOKENS = ("<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>")
SPECIAL_STRINGS = (BOS, EOS, USER, ASSISTANT, LATEST_REMINDER, DSML, THINK_START, THINK_END, *TASK_TOKENS)

CALLS_OPEN = f"<{DSML}tool_calls>"
CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAM_CLOSE = f"</{DSML}parameter>"
_INVOKE_OPEN = re.compile(f'<{DSML}invoke name="([^"<>\\n]+)">\n')
_PARAM_OPEN = re.compile(f'<{DSML}parameter name="([^"<>\\n]+)" string="(true|false)">')


def is_deepseek_v4(architecture: str | None) -> bool:
    """Whether an HF architecture name (``DeepseekV4ForCausalLM``) or model type is DeepSeek-V4."""
    if not architecture:
        return False
    return architecture.lower().replace("_", "").replace("-", "").startswith("deepseekv4")


def has_special_string(text: str) -> bool:
    """Whether ``text`` holds any of the encoder's special strings."""
    return any(special in text for special in SPECIAL_STRINGS)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _is_json(text: str) -> bool:
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        return False
    return True


class DsmlToolParser(ToolParser):
    """DeepSeek-V4's DSML call block."""

    name = "dsml"
    opener = CALLS_OPEN

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParsedToolCalls | None:
        """As the base parser, except that prose holding DSML markup is never a plain answer before calls."""
        start = text.find(CALLS_OPEN)
        if start >= 0 and has_special_string(text[:start]):
            return None
        return super().parse(text, tools)

    def parse_block(self, block: str, schemas: Mapping[str, Mapping[str, Any]]) -> list[ToolCall] | None:
        if not block.startswith(CALLS_OPEN + "\n"):
            return None
        pos = len(CALLS_OPEN) + 1
        calls: list[ToolCall] = []
        while not block.startswith(CALLS_CLOSE, pos):
            invoke = _INVOKE_OPEN.match(block, pos)
            if invoke is None:
                return None
            pos = invoke.end()
            members: list[str] = []
            seen: set[str] = set()
            while not block.startswith(INVOKE_CLOSE + "\n", pos):
                param = _PARAM_OPEN.match(block, pos)
                if param is None:
                    return None
                name, is_string = param.group(1), param.group(2) == "true"
                end = block.find(PARAM_CLOSE, param.end())
                if end < 0 or name in seen or not block.startswith("\n", end + len(PARAM_CLOSE)):
                    return None
                value = block[param.end():end]
                if has_special_string(value) or not (is_string or _is_json(value)):
                    return None
                seen.add(name)
                members.append(f"{json.dumps(name, ensure_ascii=False)}: "
                               + (json.dumps(value, ensure_ascii=False) if is_string else value.strip()))
                pos = end + len(PARAM_CLOSE) + 1
            pos += len(INVOKE_CLOSE) + 1
            calls.append(ToolCall(invoke.group(1), "{" + ", ".join(members) + "}"))
        if block[pos + len(CALLS_CLOSE):].strip():
            return None  # text after the block
        return calls or None


def _format_value(value: Any) -> tuple[str, str]:
    """(string attribute, text) of one argument value."""
    if isinstance(value, str):
        return "true", value
    return "false", json.dumps(value, ensure_ascii=False)


def render_dsml_calls(calls: Sequence[Mapping[str, Any]]) -> str:
    """The DSML block for OpenAI-shaped tool calls (arguments as a mapping or JSON text), without the
    blank line that separates it from the answer."""
    lines = [CALLS_OPEN]
    for call in calls:
        function = call.get("function", call) if isinstance(call, Mapping) else {}
        name = function.get("name") if isinstance(function, Mapping) else None
        arguments = function.get("arguments", {}) if isinstance(function, Mapping) else {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                arguments = None
        if not isinstance(name, str) or not isinstance(arguments, Mapping):
            raise ValueError("each tool call needs a function name and JSON-object arguments")
        lines.append(f'<{DSML}invoke name="{name}">')
        for key, value in arguments.items():
            string, text = _format_value(value)
            lines.append(f'<{DSML}parameter name="{key}" string="{string}">{text}{PARAM_CLOSE}')
        lines.append(INVOKE_CLOSE)
    lines.append(CALLS_CLOSE)
    return "\n".join(lines)
