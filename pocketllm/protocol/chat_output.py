"""How a chat answer is read back: the checkpoint's reasoning and call syntax, fixed per request.

``detect_chat_syntax`` decides once per checkpoint, from its template (or architecture) and tokenizer,
whether it writes ``<think>`` blocks and which call syntax it uses. ``chat_output_spec`` then fixes, for
one rendered prompt, where the output starts (inside the reasoning or not) and which tools type the
arguments. The engine's output processor applies the spec: reasoning split first, then stop strings on the
answer only, then the all-or-nothing call parse.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pocketllm.protocol.deepseek_v4 import is_deepseek_v4
from pocketllm.protocol.reasoning import OPEN, ReasoningSyntax, detect_reasoning, initial_state
from pocketllm.protocol.tool_parsers import ToolParser, select_tool_parser

__all__ = ["ChatOutputSpec", "ChatSyntax", "chat_output_spec", "detect_chat_syntax"]


@dataclass(frozen=True)
class ChatSyntax:
    """What a checkpoint writes besides plain answer text."""

    reasoning: ReasoningSyntax | None = None
    tool_parser: ToolParser | None = None


@dataclass(frozen=True)
class ChatOutputSpec:
    """How one request's output is split: reasoning (and where it starts), and the call parser with the
    request's tools (whose schemas type the arguments)."""

    reasoning: ReasoningSyntax | None = None
    reasoning_state: str = OPEN
    tool_parser: ToolParser | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None

    @property
    def markers(self) -> tuple[str, ...]:
        """Strings the decoded text must keep (special tokens among them are not skipped)."""
        found: list[str] = []
        if self.reasoning is not None:
            found += [self.reasoning.start, self.reasoning.end]
        if self.tool_parser is not None:
            found += list(self.tool_parser.markers)
        return tuple(found)


def detect_chat_syntax(template: str | None, architecture: str | None = None,
                       has_token: Callable[[str], bool] | None = None) -> ChatSyntax:
    """The checkpoint's reasoning and call syntax, from its template, architecture and tokenizer."""
    own_encoder = template is None and is_deepseek_v4(architecture)
    return ChatSyntax(reasoning=detect_reasoning(template, has_token, encoder_writes_reasoning=own_encoder),
                      tool_parser=select_tool_parser(template, architecture))


def chat_output_spec(syntax: ChatSyntax, prompt: str,
                     tools: Sequence[Mapping[str, Any]] | None = None) -> ChatOutputSpec | None:
    """The split for one rendered prompt, or None when the checkpoint writes plain text only."""
    if syntax.reasoning is None and syntax.tool_parser is None:
        return None
    state = initial_state(syntax.reasoning, prompt) if syntax.reasoning is not None else OPEN
    return ChatOutputSpec(reasoning=syntax.reasoning, reasoning_state=state, tool_parser=syntax.tool_parser,
                          tools=tuple(tools) if tools else None)
