"""Which call syntax a checkpoint writes, read from its own chat template (or its architecture).

The template is asked to render a probe conversation that holds one assistant tool call, and the syntax it
writes is the one the model was taught: Qwen's XML (``<function=…>``), Hermes JSON inside ``<tool_call>``, or
DeepSeek's DSML. A template that writes none of them (or cannot render a call) gets no parser, so calls stay
in the answer text rather than being read by a syntax nobody checked. DeepSeek-V4 checkpoints without a
template use our own encoder, which writes DSML.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache

from pocketllm.errors import PocketLLMError
from pocketllm.protocol.chat_template import render_chat_template
from pocketllm.protocol.tool_parsers.base import ToolParser
from pocketllm.protocol.tool_parsers.dsml import DSML, DsmlToolParser, is_deepseek_v4
from pocketllm.protocol.tool_parsers.hermes import HermesToolParser
from pocketllm.protocol.tool_parsers.qwen_xml import QwenXmlToolParser

__all__ = ["select_tool_parser", "template_call_syntax"]

_PROBE_FUNCTION = "probe_function"
_PROBE_ARGUMENT = "probe_argument"
_PROBE_TOOL = {"type": "function", "function": {
    "name": _PROBE_FUNCTION, "description": "probe",
    "parameters": {"type": "object", "properties": {_PROBE_ARGUMENT: {"type": "string"}}}}}
_PROBE_MESSAGES = [
    {"role": "user", "content": "probe question"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_probe", "type": "function",
        "function": {"name": _PROBE_FUNCTION, "arguments": json.dumps({_PROBE_ARGUMENT: "probe value"})}}]},
    {"role": "tool", "tool_call_id": "call_probe", "content": "probe result"},
]
_HERMES_BODY = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)

PARSERS: dict[str, type[ToolParser]] = {
    QwenXmlToolParser.name: QwenXmlToolParser,
    HermesToolParser.name: HermesToolParser,
    DsmlToolParser.name: DsmlToolParser,
}


def _syntax_of(rendered: str) -> str | None:
    if f"<function={_PROBE_FUNCTION}>" in rendered and f"<parameter={_PROBE_ARGUMENT}>" in rendered:
        return QwenXmlToolParser.name
    if f'<{DSML}invoke name="{_PROBE_FUNCTION}">' in rendered:
        return DsmlToolParser.name
    for body in _HERMES_BODY.findall(rendered):
        try:
            call = json.loads(body)
        except ValueError:
            continue
        if isinstance(call, dict) and call.get("name") == _PROBE_FUNCTION:
            return HermesToolParser.name
    return None


@lru_cache(maxsize=32)
def template_call_syntax(template: str) -> str | None:
    """The name of the call syntax the template writes for an assistant tool call, or None."""
    for tools in ([_PROBE_TOOL], None):
        try:
            rendered = render_chat_template(template, _PROBE_MESSAGES, add_generation_prompt=True, tools=tools)
        except (PocketLLMError, ValueError, TypeError, LookupError):
            continue
        return _syntax_of(rendered)
    return None


def select_tool_parser(template: str | None, architecture: str | None = None) -> ToolParser | None:
    """The parser for the checkpoint's call syntax, or None when it has none this server has read."""
    if template is None:
        return DsmlToolParser() if is_deepseek_v4(architecture) else None
    syntax = template_call_syntax(template)
    return PARSERS[syntax]() if syntax else None
