"""``/v1/responses`` bodies made into chat requests: input items to messages, flat tools to chat tools.

The Responses API runs on the chat path: its ``input`` items (messages, ``function_call``,
``function_call_output``, replayed ``reasoning``) become the chat messages the checkpoint's template renders,
``instructions`` a system message before them, its flat function tools and ``tool_choice`` the chat spellings,
``text.format`` a ``response_format`` and ``reasoning.effort`` a ``reasoning_effort``. Every field is checked
against the ``responses`` rows of the policy table (``openai_fields.FIELD_POLICY``): acted on, or a 400 naming it.
Nothing is stored, so ``store: true`` and ``previous_response_id`` are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_request import REASONING_EFFORTS
from pocketllm.protocol.openai_fields import (
    CHAT,
    RESPONSES,
    ParsedRequest,
    body_mapping,
    chat_options_of,
    check_caps,
    check_known_fields,
    check_refused_rows,
    invalid_field,
    is_list,
    object_field,
    present_fields,
    sampling_fields,
    show_value,
    unsupported_field,
    vocab_size_of,
    whole_number,
)

__all__ = ["ResponsesRequest", "chat_param", "parse_responses_request", "responses_error"]

_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
# Chat option names (which the chat checks name in their errors) and the Responses field each comes from.
_CHAT_PARAMS = {"response_format": "text", "reasoning_effort": "reasoning", "messages": "input",
                "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens"}


def chat_param(param: str | None) -> str | None:
    """The Responses field that a chat-path error's ``param`` stands for."""
    return _CHAT_PARAMS.get(param, param) if param is not None else None


def responses_error(exc: InvalidRequestError) -> InvalidRequestError:
    """A chat-path refusal restated for ``/v1/responses``: its ``param`` is the Responses field it came from."""
    param = chat_param(exc.param)
    if param == exc.param:
        return exc
    return InvalidRequestError(f'{exc.message} (on /v1/responses this is "{param}")', param=param)


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated ``/v1/responses`` body: the chat request it runs as, and what the response echoes."""

    chat: ParsedRequest
    echo: dict[str, Any] = field(default_factory=dict)


def _bad_input(value: Any, index: int | None, problem: str, advice: str) -> InvalidRequestError:
    where = f" (item {index})" if index is not None else ""
    return InvalidRequestError(
        f'"input"{where} holds {show_value(value)}, which is not valid here: {problem}. {advice}.', param="input")


def _text_of(content: Any, index: int, what: str, assistant: bool = False) -> str:
    """The text of a message's content: a string, or a list of text parts (an assistant's ``refusal`` parts, as
    a refused response's output holds them, are what it said)."""
    if isinstance(content, str):
        return content
    if not is_list(content):
        raise _bad_input(content, index, f"the {what} must be a string or a list of content parts",
                         'Send the content as a string or as [{"type": "input_text", "text": ...}]')
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = "text" if kind in _TEXT_PARTS else "refusal" if assistant and kind == "refusal" else None
        if key is None or not isinstance(part.get(key), str):
            raise _bad_input(part, index, f"only text parts ({', '.join(_TEXT_PARTS)}; refusal in an assistant "
                             "message) are read; this server takes no images, files or audio", "Send text parts only")
        texts.append(part[key])
    return "".join(texts)


def _reasoning_text(item: Mapping[str, Any], index: int) -> str:
    parts = item.get("content") or item.get("summary") or []
    if not is_list(parts) or not all(isinstance(p, Mapping) and isinstance(p.get("text"), str) for p in parts):
        raise _bad_input(item, index, "a reasoning item's content must be a list of text parts",
                         'Replay the reasoning item as returned, with "content": [{"type": "reasoning_text", ...}]')
    return "".join(p["text"] for p in parts)


def _messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """The chat messages of ``input`` (after the ``instructions`` system message)."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not is_list(value) or not value:
        raise invalid_field("input", value, "a string or a non-empty array of input items")
    reasoning: str | None = None   # a replayed reasoning item, for the assistant turn after it

    def assistant() -> dict[str, Any]:
        nonlocal reasoning
        turn: dict[str, Any] = {"role": "assistant", "content": None}
        if reasoning is not None:
            turn["reasoning_content"], reasoning = reasoning, None
        messages.append(turn)
        return turn

    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise _bad_input(item, index, "an input item must be an object", "Send each item as an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _MESSAGE_ROLES:
                raise _bad_input(item, index, f"a message's role must be one of {', '.join(_MESSAGE_ROLES)}",
                                 "Send each message with one of those roles")
            text = _text_of(item.get("content"), index, "message content", role == "assistant")
            if role == "assistant":
                assistant()["content"] = text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments, call_id = item.get("name"), item.get("arguments"), item.get("call_id")
            if not all(isinstance(v, str) and v for v in (name, call_id)) or not isinstance(arguments, str):
                raise _bad_input(item, index, 'a function_call item needs "call_id", "name" and "arguments" strings',
                                 "Send the function_call item back as the response returned it")
            last = messages[-1] if messages else None
            turn = last if last is not None and last["role"] == "assistant" and reasoning is None else assistant()
            turn.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str) or not call_id:
                raise _bad_input(item, index, 'a function_call_output item needs the "call_id" of its call',
                                 'Send the "call_id" of the function_call it answers')
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text_of(item.get("output"), index, "function output")})
        elif kind == "reasoning":
            reasoning = _reasoning_text(item, index)
        else:
            raise _bad_input(item, index, f"items of type {show_value(kind)} are not read by this server",
                             "Send message, function_call, function_call_output and reasoning items only")
    if not any(m["role"] != "system" for m in messages):
        raise invalid_field("input", value, "input holding at least one message or item besides instructions")
    return messages


def _tools(value: Any) -> list[dict[str, Any]]:
    """Flat Responses function tools as chat tools."""
    if not is_list(value):
        raise invalid_field("tools", value, "an array of tool objects")
    tools = []
    for tool in value:
        if not isinstance(tool, Mapping) or tool.get("type") != "function":
            raise unsupported_field("tools", value,
                                    f"the tool {show_value(tool)} is not a function tool; this server runs "
                                    "no built-in tools", 'Send function tools only: {"type": "function", "name": ...}')
        name = tool.get("name")
        extra = sorted(k for k, v in tool.items() if k not in _TOOL_KEYS and v is not None)
        if not isinstance(name, str) or not name or extra:
            problem = f"it carries {', '.join(map(repr, extra))}, which this server does not act on" if extra \
                else 'it has no "name"'
            raise unsupported_field("tools", value, f"the tool {show_value(tool)} cannot be used: {problem}",
                               'Send {"type": "function", "name", "description", "parameters", "strict"}')
        function = {"name": name}
        for key in ("description", "parameters"):
            if tool.get(key) is not None:
                function[key] = tool[key]
        tools.append({"type": "function", "function": function})
    return tools


def _tool_choice(value: Any) -> Any:
    """``tool_choice`` in the chat spelling; refusals quote and describe the Responses spelling sent."""
    if value in ("auto", "none", "required"):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function":
        name = value.get("name")
        if set(value) <= {"type", "name"} and isinstance(name, str) and name:
            return {"type": "function", "function": {"name": name}}
        raise invalid_field("tool_choice", value, '"auto", "none", "required" or {"type": "function", "name": ...} '
                            '(a non-empty name beside "type")', "Send one of those, or omit it")
    raise unsupported_field("tool_choice", value, "only auto, none, required and a named function are acted on",
                       'Send "auto", "none", "required" or {"type": "function", "name": ...}')


def _text_format(value: Any) -> dict[str, Any] | None:
    """``text``'s format as chat's ``response_format`` (None for plain text)."""
    text = object_field("text", value)
    for key, item in text.items():
        if key == "verbosity" and item is not None:
            raise unsupported_field("text", value, "the answer's length is not steered by a verbosity level",
                               'Omit "verbosity"; bound the length with "max_output_tokens"')
        if key not in ("format", "verbosity"):
            raise unsupported_field("text", value, f'"{key}" is not a text option this server knows',
                                    'Send "format" only')
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = object_field("text", fmt)
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise invalid_field("text", value, 'a format with a "schema" object when its type is json_schema')
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"]}
        if fmt.get("strict") is not None:
            spec["strict"] = fmt["strict"]
        return {"type": "json_schema", "json_schema": spec}
    raise invalid_field("text", value, 'an object whose format type is "text", "json_object" or "json_schema"')


def _reasoning_effort(value: Any) -> str | None:
    reasoning = object_field("reasoning", value)
    for key, item in reasoning.items():
        if key in ("summary", "generate_summary") and item is not None:
            raise unsupported_field("reasoning", value,
                                    "no summary is written: the model's reasoning is returned whole "
                                    "as a reasoning item", f'Omit "{key}"')
        if key not in ("effort", "summary", "generate_summary") and item is not None:
            raise unsupported_field("reasoning", value, f'"{key}" is not a reasoning option this server acts on',
                               'Send "effort" only')
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise invalid_field("reasoning", value, f'an object whose "effort" is one of {", ".join(REASONING_EFFORTS)}')
    return effort


def parse_responses_request(body: Mapping[str, Any], caps: Any = None) -> ResponsesRequest:
    """Validate a ``/v1/responses`` body against the policy table and ``caps``; the chat request it runs as."""
    body = body_mapping(body)
    check_known_fields(body, RESPONSES)
    fields = present_fields(body)
    if "input" not in fields:
        raise InvalidRequestError('"input" is required: send a string or an array of input items.', param="input")
    check_refused_rows(fields, RESPONSES)
    instructions = fields.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid_field("instructions", instructions, "a string")
    messages = _messages(fields["input"], instructions)
    stream = fields.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid_field("stream", stream, "true or false")
    sampling = sampling_fields({k: fields[k] for k in ("temperature", "top_p") if k in fields}, vocab_size_of(caps))
    if "max_output_tokens" in fields:
        sampling["max_tokens"] = whole_number("max_output_tokens", fields["max_output_tokens"], 1, None,
                                        "a whole number of tokens, at least 1")
    chat_fields: dict[str, Any] = {}
    if "tools" in fields:
        chat_fields["tools"] = _tools(fields["tools"])
    if "tool_choice" in fields:
        chat_fields["tool_choice"] = _tool_choice(fields["tool_choice"])
    if "parallel_tool_calls" in fields:
        chat_fields["parallel_tool_calls"] = fields["parallel_tool_calls"]
    if "text" in fields:
        fmt = _text_format(fields["text"])
        if fmt is not None:
            chat_fields["response_format"] = fmt
    if "reasoning" in fields:
        effort = _reasoning_effort(fields["reasoning"])
        if effort is not None:
            chat_fields["reasoning_effort"] = effort
    try:
        options = chat_options_of(chat_fields, caps, tool_choice_as_sent=fields.get("tool_choice"))
    except InvalidRequestError as exc:
        raise responses_error(exc) from None
    check_caps(body, sampling, 1, caps)
    chat = ParsedRequest(endpoint=CHAT, messages=messages, prompts=None, sampling=sampling, n=1, stream=stream,
                         want_logprobs=False, chat_options=options, request_id=None, drop_thinking=None)
    echo = {name: fields.get(name) for name in ("instructions", "max_output_tokens", "metadata", "temperature",
                                                 "top_p", "user", "reasoning", "text")}
    echo["tools"] = list(fields.get("tools", []))
    echo["tool_choice"] = fields.get("tool_choice", "auto")
    echo["parallel_tool_calls"] = fields.get("parallel_tool_calls", True)
    return ResponsesRequest(chat=chat, echo=echo)
