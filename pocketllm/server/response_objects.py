"""The Responses API's objects (``openai.types.responses``): output items, usage and the response itself."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from pocketllm.protocol.responses_request import ResponsesRequest

# A chat finish_reason -> (response status, incomplete_details reason).
_STATUS = {"length": ("incomplete", "max_output_tokens"), "cancelled": ("cancelled", None)}


def item_id(prefix: str) -> str:
    """A fresh output-item id: ``msg_…``, ``fc_…``, ``rs_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(id_: str, text: str, status: str) -> dict[str, Any]:
    return {"id": id_, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def output_text(text: str) -> dict[str, Any]:
    """An ``output_text`` content part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(id_: str, text: str | None, status: str) -> dict[str, Any]:
    return {"id": id_, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)] if text is not None else []}


def function_call_item(id_: str, call: Mapping[str, Any], status: str, arguments: str | None = None) -> dict[str, Any]:
    """A ``function_call`` item of an OpenAI chat tool call (``arguments`` overrides the call's)."""
    function = call["function"]
    return {"id": id_, "type": "function_call", "call_id": call["id"], "name": function["name"],
            "arguments": function["arguments"] if arguments is None else arguments, "status": status}


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """The response's status and ``incomplete_details`` for a chat choice's finish reason."""
    status, reason = _STATUS.get(finish_reason or "stop", ("completed", None))
    return status, ({"reason": reason} if reason else None)


def output_items(choice: Mapping[str, Any]) -> list[dict[str, Any]]:
    """A chat completion choice as output items: reasoning, then the message, then one item per call."""
    message = choice["message"]
    status, _ = status_of(choice.get("finish_reason"))
    item_status = "incomplete" if status == "incomplete" else "completed"
    items = []
    if message.get("reasoning_content") is not None:
        items.append(reasoning_item(item_id("rs"), message["reasoning_content"], item_status))
    if message.get("content"):
        items.append(message_item(item_id("msg"), message["content"], item_status))
    items.extend(function_call_item(item_id("fc"), call, "completed") for call in message.get("tool_calls") or [])
    return items


def usage(chat_usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A chat usage object in the Responses spelling."""
    if chat_usage is None:
        return None
    return {"input_tokens": chat_usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def response_body(response_id: str, created: int, model: str, request: ResponsesRequest, *, status: str,
                  output: list[dict[str, Any]], usage_: dict[str, Any] | None = None,
                  incomplete: dict[str, Any] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``response`` object, echoing the request's settings."""
    echo = request.echo
    text = echo.get("text") or {}
    return {
        "id": response_id, "object": "response", "created_at": created, "model": model, "status": status,
        "output": output, "error": error, "incomplete_details": incomplete,
        "instructions": echo.get("instructions"), "max_output_tokens": echo.get("max_output_tokens"),
        "metadata": echo.get("metadata") or {}, "parallel_tool_calls": echo["parallel_tool_calls"],
        "previous_response_id": None, "reasoning": echo.get("reasoning") or {"effort": None, "summary": None},
        "temperature": echo.get("temperature"), "top_p": echo.get("top_p"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": echo["tool_choice"], "tools": echo["tools"], "truncation": "disabled",
        "usage": usage_, "user": echo.get("user"),
    }


def completed_response(completion: Mapping[str, Any], request: ResponsesRequest, response_id: str,
                       model: str) -> dict[str, Any]:
    """The whole response of a finished chat completion (one choice)."""
    choice = completion["choices"][0]
    status, incomplete = status_of(choice.get("finish_reason"))
    return response_body(response_id, completion["created"], model, request, status=status,
                         output=output_items(choice), usage_=usage(completion.get("usage")), incomplete=incomplete)
