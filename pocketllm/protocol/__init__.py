"""Torch-free request protocol helpers: chat templates, stop strings, incremental detokenisation."""

from pocketllm.protocol.chat_template import normalize_messages, render_chat_template, template_supports_tools
from pocketllm.protocol.detokenizer import IncrementalDetokenizer
from pocketllm.protocol.stop import StopMatcher, find_stop, truncate_at_stop

__all__ = [
    "IncrementalDetokenizer",
    "StopMatcher",
    "find_stop",
    "normalize_messages",
    "render_chat_template",
    "template_supports_tools",
    "truncate_at_stop",
]
