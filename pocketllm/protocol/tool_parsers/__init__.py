"""Tool-call parsers, one file per syntax, and the selector that picks one from the checkpoint's template."""

from pocketllm.protocol.tool_parsers.base import ParsedToolCalls, ToolCall, ToolCallStream, ToolParser, typed_value
from pocketllm.protocol.tool_parsers.dsml import DsmlToolParser
from pocketllm.protocol.tool_parsers.hermes import HermesToolParser
from pocketllm.protocol.tool_parsers.qwen_xml import QwenXmlToolParser
from pocketllm.protocol.tool_parsers.selector import select_tool_parser, template_call_syntax

__all__ = [
    "DsmlToolParser",
    "HermesToolParser",
    "ParsedToolCalls",
    "QwenXmlToolParser",
    "ToolCall",
    "ToolCallStream",
    "ToolParser",
    "select_tool_parser",
    "template_call_syntax",
    "typed_value",
]
