"""Chat options → the prompt text: checks what the checkpoint's template can honour, then renders it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_template import render_chat_template, template_supports_tools

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _template_uses(template: str, name: str) -> bool:
    return name in template


def build_chat_prompt(template: str | None, messages: Sequence[Mapping[str, Any]], *,
                      special_tokens: Mapping[str, str | None] | None = None,
                      tools: Sequence[Mapping[str, Any]] | None = None,
                      tool_choice: Any = None,
                      response_format: Mapping[str, Any] | None = None,
                      reasoning_effort: str | None = None,
                      thinking_mode: bool | None = None,
                      add_generation_prompt: bool = True,
                      chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
    """Render ``messages`` through the checkpoint's template, refusing options it cannot act on."""
    if template is None:
        raise InvalidRequestError(
            "this model ships no chat template, so a conversation cannot be encoded for it; "
            "send a plain prompt (generate / completions) instead", param="messages")
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of message objects", param="messages")
    kwargs: dict[str, Any] = dict(chat_template_kwargs or {})
    if tools:
        if not template_supports_tools(template):
            raise InvalidRequestError(
                "this model's chat template has no tool support, so tool definitions cannot reach the model; "
                "remove 'tools' or use a model whose template renders them", param="tools")
    if tool_choice not in (None, "auto"):
        raise InvalidRequestError(
            f"tool_choice={tool_choice!r} is not supported: the model is not constrained to call or skip tools. "
            "Send tool_choice 'auto' or omit it", param="tool_choice")
    if response_format is not None and dict(response_format).get("type", "text") != "text":
        raise InvalidRequestError(
            "response_format other than {'type': 'text'} needs structured outputs, which this engine does "
            "not declare; omit it or send {'type': 'text'}", param="response_format")
    if reasoning_effort is not None:
        if reasoning_effort not in REASONING_EFFORTS:
            raise InvalidRequestError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
                                      param="reasoning_effort")
        if not _template_uses(template, "reasoning_effort"):
            raise InvalidRequestError(
                "this model's chat template takes no reasoning effort; omit reasoning_effort",
                param="reasoning_effort")
        kwargs["reasoning_effort"] = reasoning_effort
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
    return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                tools=list(tools) if tools else None, special_tokens=special_tokens, **kwargs)
