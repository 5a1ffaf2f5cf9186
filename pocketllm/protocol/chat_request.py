"""Chat options → the prompt text: checks what the checkpoint's template can honour, then renders it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol import deepseek_v4
from pocketllm.protocol.chat_template import check_tool_replies, render_chat_template, template_supports_tools
from pocketllm.protocol.reasoning import (
    check_reasoning_kept,
    drop_earlier_reasoning,
    effort_from_reasoning,
    template_reasoning_effort,
)
from pocketllm.protocol.structured_output import NONE, check_response_format, check_tool_choice, tool_calls_as_text

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _template_uses(template: str, name: str) -> bool:
    return name in template


def build_chat_prompt(template: str | None, messages: Sequence[Mapping[str, Any]], *,
                      special_tokens: Mapping[str, str | None] | None = None,
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      tool_choice: Any = None,
                      parallel_tool_calls: bool | None = None,
                      response_format: Mapping[str, Any] | None = None,
                      reasoning_effort: str | None = None,
                      thinking_mode: bool | None = None,
                      add_generation_prompt: bool = True,
                      chat_template_kwargs: Mapping[str, Any] | None = None,
                      structured_outputs: bool = False,
                      architecture: str | None = None,
                      drop_thinking: bool | None = None,
                      reasoning: Mapping[str, Any] | None = None) -> str:
    """Render ``messages`` through the checkpoint's template, refusing options it cannot act on.

    ``structured_outputs``: whether the engine declares them; a forced ``tool_choice`` and a JSON
    ``response_format`` need them (the grammar itself is built by ``structured_output.structured_output_for``).
    ``tool_choice`` ``"none"`` keeps the tools out of the template; a forced call on a template that cannot
    render tools is still served, since the grammar carries the tools' schemas.
    ``architecture``: the checkpoint's; a DeepSeek-V4 checkpoint without a template is encoded by our own
    encoder of its documented format. ``drop_thinking``: leave out (true) or keep (false) the reasoning of
    assistant turns before the last user message. ``reasoning``: ``{"effort": ...}``, another spelling of
    ``reasoning_effort``.
    """
    if reasoning is not None:
        reasoning_effort = effort_from_reasoning(reasoning, reasoning_effort)
    if template is None and not deepseek_v4.is_deepseek_v4(architecture):
        raise InvalidRequestError(
            "this model ships no chat template, so a conversation cannot be encoded for it; "
            "send a plain prompt (generate / completions) instead", param="messages")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects", param="messages")
    check_tool_replies(messages)
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    mode = check_tool_choice(tool_choice, tools, parallel_tool_calls, structured_outputs=structured_outputs)
    if mode == NONE:
        tools = None
    if template is None:
        check_response_format(response_format, structured_outputs=structured_outputs, tool_choice=tool_choice)
        return _deepseek_v4_prompt(messages, tools=tools, response_format=response_format,
                                   reasoning_effort=reasoning_effort, thinking_mode=thinking_mode,
                                   drop_thinking=drop_thinking, add_generation_prompt=add_generation_prompt,
                                   chat_template_kwargs=kwargs)
    if tools and not template_supports_tools(template):
        if mode == "auto":
            raise InvalidRequestError(
                "this model's chat template has no tool support, so tool definitions cannot reach the model; "
                "remove 'tools', use a model whose template renders them, or force a call with tool_choice "
                "'required' or a named function", param="tools")
        tools = None  # a forced call: the grammar holds the tools' schemas
    check_response_format(response_format, structured_outputs=structured_outputs, tool_choice=tool_choice)
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                      param="reasoning_effort")
        kwargs["reasoning_effort"] = template_reasoning_effort(template, reasoning_effort)
    if thinking_mode is not None:
        if not isinstance(thinking_mode, bool):
            raise InvalidRequestError("thinking_mode must be a boolean", param="thinking_mode")
        if not _template_uses(template, "enable_thinking"):
            raise InvalidRequestError(
                "this model's chat template has no thinking switch; omit thinking_mode", param="thinking_mode")
        kwargs["enable_thinking"] = thinking_mode
    # OpenAI's "developer" role is the system role of newer models; templates know only "system".
    messages = [{**m, "role": "system"} if isinstance(m, Mapping) and m.get("role") == "developer" else m
                for m in messages]
    if not template_supports_tools(template):
        messages = tool_calls_as_text(messages)  # replaying a forced call on a template without tool syntax
    if drop_thinking:
        messages = drop_earlier_reasoning(messages)
    rendered = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    tools=list(tools) if tools else None, special_tokens=special_tokens, **kwargs)
    if drop_thinking is False:
        check_reasoning_kept(messages, rendered)
    return rendered


def _deepseek_v4_prompt(messages: Sequence[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None,
                        response_format: Mapping[str, Any] | None, reasoning_effort: str | None,
                        thinking_mode: bool | None, drop_thinking: bool | None, add_generation_prompt: bool,
                        chat_template_kwargs: Mapping[str, Any]) -> str:
    """DeepSeek-V4's own prompt format (no template): thinking_mode picks "thinking" or "chat" (the default)."""
    if chat_template_kwargs:
        raise InvalidRequestError(
            "this model has no chat template, so chat_template_kwargs has nothing to reach; omit it",
            param="chat_template_kwargs")
    if thinking_mode is not None and not isinstance(thinking_mode, bool):
        raise InvalidRequestError("thinking_mode must be a boolean", param="thinking_mode")
    if reasoning_effort is not None and reasoning_effort not in deepseek_v4.REASONING_EFFORTS:
        if reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                      param="reasoning_effort")
        reasoning_effort = {"xhigh": "max"}.get(reasoning_effort, reasoning_effort)
    fmt = response_format if response_format and response_format.get("type") != "text" else None
    return deepseek_v4.encode_messages(
        messages, thinking_mode="thinking" if thinking_mode else "chat",
        drop_thinking=True if drop_thinking is None else drop_thinking, reasoning_effort=reasoning_effort,
        tools=tools, response_format=fmt, add_generation_prompt=add_generation_prompt)
