"""Structured outputs at the protocol level: ``response_format``, forced ``tool_choice`` and its parsing.

What a chat request asks the grammar for:

- ``response_format`` ``{"type": "json_object"}``: any JSON object; ``{"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}``: JSON valid against ``schema``.
- ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` (a *forced* call):
  a JSON array of ``{"name", "arguments"}`` objects, each naming one of the request's tools and carrying
  arguments valid against that tool's ``parameters`` schema (at least one call; exactly one for a named
  function or with ``parallel_tool_calls: false``). The answer is parsed back from that array into OpenAI
  ``tool_calls``. ``"none"`` keeps the tools away from the template, so no call is offered.

The checks here look at shapes only and import nothing heavy; :func:`structured_output_for` builds the
``StructuredOutput`` (whose construction asks xgrammar whether the schema compiles). No torch here.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.reasoning import ANSWER, INSIDE
from pocketllm.sampling_params import StructuredOutput

__all__ = [
    "after_reasoning",
    "check_response_format",
    "check_tool_choice",
    "forced_tool_call_schema",
    "is_forced_tool_choice",
    "parse_forced_tool_calls",
    "structured_output_for",
    "tool_calls_as_text",
    "tool_choice_mode",
]

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "named"


def _show(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _refuse(field: str, value: Any, reason: str, advice: str) -> InvalidRequestError:
    return InvalidRequestError(f'"{field}" = {_show(value)} is not supported by this server: {reason}. {advice}.',
                               param=field)


def _tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    names = []
    for tool in tools or ():
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping) and isinstance(function.get("name"), str):
            names.append(function["name"])
    return names


def tool_choice_mode(tool_choice: Any) -> str:
    """``auto``, ``none``, ``required`` or ``named`` (a function object); anything else is a 400."""
    if tool_choice is None or tool_choice == AUTO:
        return AUTO
    if tool_choice in (NONE, REQUIRED):
        return tool_choice
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        if isinstance(function, Mapping) and isinstance(function.get("name"), str) and function["name"]:
            return NAMED
    raise InvalidRequestError(
        f'"tool_choice" = {_show(tool_choice)} is not valid here: it must be "auto", "none", "required" or '
        '{"type": "function", "function": {"name": ...}}. Send one of those, or omit it.', param="tool_choice")


def is_forced_tool_choice(tool_choice: Any) -> bool:
    """Whether ``tool_choice`` forces a call (``required`` or a named function)."""
    return tool_choice_mode(tool_choice) in (REQUIRED, NAMED)


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None,
                      parallel_tool_calls: Any = None, *, structured_outputs: bool, as_sent: Any = None) -> str:
    """Validate ``tool_choice`` and ``parallel_tool_calls`` against the tools and the engine; return the mode.

    A forced call needs tools (the named one among them) and an engine with structured outputs.
    ``parallel_tool_calls: false`` is enforced only where the grammar can enforce it (a forced call) or
    where no call is offered at all (``none``); elsewhere the model's own call syntax is not limited.
    ``as_sent``: the value as the client spelled it, when that is not the chat spelling ``tool_choice`` has
    (``/v1/responses``' ``{"type": "function", "name": ...}``); the refusals quote it.
    """
    mode = tool_choice_mode(tool_choice)
    shown = tool_choice if as_sent is None else as_sent
    if mode in (REQUIRED, NAMED):
        if not structured_outputs:
            raise _refuse("tool_choice", shown,
                          "forcing a tool call needs structured outputs, which this engine does not declare",
                          'Send "tool_choice": "auto" or "none", or omit it')
        names = _tool_names(tools)
        if not names:
            raise _refuse("tool_choice", shown, "the request has no tools, so no call can be forced",
                          'Send the functions in "tools", or omit "tool_choice"')
        if mode == NAMED and tool_choice["function"]["name"] not in names:
            raise _refuse("tool_choice", shown,
                          f"the function {_show(tool_choice['function']['name'])} is not among the request's "
                          f"tools ({', '.join(names)})", 'Send the name of one of the "tools"')
    if parallel_tool_calls is not None:
        if not isinstance(parallel_tool_calls, bool):
            raise InvalidRequestError(
                f'"parallel_tool_calls" = {_show(parallel_tool_calls)} is not valid here: it must be true or '
                'false. Send "parallel_tool_calls" as true or false, or omit it.', param="parallel_tool_calls")
        if not parallel_tool_calls and mode == AUTO:
            raise _refuse("parallel_tool_calls", False,
                          "the number of tool calls the model writes in its own syntax is not limited; only a "
                          "forced call (tool_choice \"required\" or a named function) is held to one",
                          'Send "parallel_tool_calls": true or omit it, or force the call with "tool_choice"')
    return mode


def check_response_format(response_format: Mapping[str, Any] | None, *, structured_outputs: bool,
                          tool_choice: Any = None) -> str:
    """Validate ``response_format``'s shape against the engine; return its type (``text`` when absent)."""
    if response_format is None:
        return "text"
    if not isinstance(response_format, Mapping):
        raise InvalidRequestError(f'"response_format" = {_show(response_format)} is not valid here: it must be '
                                  'a JSON object. Send {"type": "text"} or omit it.', param="response_format")
    kind = response_format.get("type", "text")
    if kind == "text":
        return kind
    if kind not in ("json_object", "json_schema"):
        raise InvalidRequestError(
            f'"response_format" = {_show(response_format)} is not valid here: its "type" must be "text", '
            '"json_object" or "json_schema". Send one of those, or omit it.', param="response_format")
    if not structured_outputs:
        raise InvalidRequestError(
            "response_format other than {'type': 'text'} needs structured outputs, which this engine does "
            "not declare; omit it or send {'type': 'text'}", param="response_format")
    if is_forced_tool_choice(tool_choice):
        raise _refuse("response_format", response_format,
                      "a forced tool_choice already constrains the answer to a list of tool calls, so the format "
                      "would not be applied", 'Omit "response_format" or send {"type": "text"} with a forced call')
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise InvalidRequestError(
                f'"response_format" = {_show(response_format)} is not valid here: a json_schema format carries '
                '{"json_schema": {"name": ..., "schema": {...}}} with the JSON Schema as an object. Send the '
                "schema under json_schema.schema.", param="response_format")
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidRequestError('"response_format" json_schema.name must be a string. Send a string name.',
                                      param="response_format")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InvalidRequestError('"response_format" json_schema.strict must be true or false. Send a '
                                      "boolean or omit it.", param="response_format")
        where = unsatisfiable_at(spec["schema"])
        if where is not None:
            raise InvalidRequestError(
                f'"response_format": the JSON Schema admits no value (at {where}), so no answer could follow it. '
                "Send a schema that some JSON value satisfies.", param="response_format")
    return kind


def unsatisfiable_at(schema: Any, path: str = "#") -> str | None:
    """Where ``schema`` plainly admits no value: ``false``, ``not: {}``, an empty ``anyOf``/``oneOf``/``enum``/
    ``type`` list, or such a node under ``allOf`` or a required property (the JSON-pointer path), else None.
    A schema that passes may still be unsatisfiable in ways only the grammar compiler finds."""
    if schema is False:
        return path
    if not isinstance(schema, Mapping):
        return None
    negated = schema.get("not")
    if negated is True or (isinstance(negated, Mapping) and not negated):
        return f"{path}/not"
    for key in ("anyOf", "oneOf", "enum", "type"):
        value = schema.get(key)
        if _is_list(value) and not value:
            return f"{path}/{key}"
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if _is_list(options) and all(unsatisfiable_at(o) is not None for o in options):
            return f"{path}/{key}"
    for i, part in enumerate(schema.get("allOf") or []):
        found = unsatisfiable_at(part, f"{path}/allOf/{i}")
        if found is not None:
            return found
    properties = schema.get("properties")
    required = schema.get("required")
    if isinstance(properties, Mapping) and _is_list(required):
        for name in required:
            if name in properties:
                found = unsatisfiable_at(properties[name], f"{path}/properties/{name}")
                if found is not None:
                    return found
    return None


def _parameters(tool: Mapping[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    params = function.get("parameters")
    if params is None:
        return {"type": "object"}
    if not isinstance(params, Mapping):
        raise InvalidRequestError(f'"tools": the parameters of {_show(function["name"])} must be a JSON Schema '
                                  "object. Send the schema as an object.", param="tools")
    return dict(params)


def forced_tool_call_schema(tools: Sequence[Mapping[str, Any]], tool_choice: Any,
                            parallel_tool_calls: bool | None = None) -> dict[str, Any]:
    """The JSON Schema of a forced answer: an array of ``{"name", "arguments"}`` calls of the allowed tools.

    A tool's ``$defs``/``definitions`` are lifted to the root so its ``#/$defs/...`` references still
    resolve; two tools defining the same name differently are a 400.
    """
    mode = tool_choice_mode(tool_choice)
    wanted = tool_choice["function"]["name"] if mode == NAMED else None
    chosen = [t for t in tools if wanted is None or t["function"]["name"] == wanted]
    shared: dict[str, dict[str, Any]] = {}
    calls = []
    for tool in chosen:
        params = _parameters(tool)
        for key in ("$defs", "definitions"):
            defs = params.pop(key, None)
            if defs is None:
                continue
            if not isinstance(defs, Mapping):
                raise InvalidRequestError(f'"tools": {key} of {_show(tool["function"]["name"])} must be an object',
                                          param="tools")
            bucket = shared.setdefault(key, {})
            for name, definition in defs.items():
                if name in bucket and bucket[name] != definition:
                    raise InvalidRequestError(
                        f'"tools": two tools define {key}/{name} differently, so one forced-call schema cannot '
                        "hold both. Rename one of the definitions.", param="tools")
                bucket[name] = definition
        calls.append({
            "type": "object",
            "properties": {"name": {"const": tool["function"]["name"]}, "arguments": params},
            "required": ["name", "arguments"],
        })
    schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                              "minItems": 1}
    if mode == NAMED or parallel_tool_calls is False:
        schema["maxItems"] = 1
    schema.update(shared)
    return schema


def structured_output_for(options: Mapping[str, Any]) -> StructuredOutput | None:
    """The grammar a chat request's options ask for (``response_format``, forced ``tool_choice``), or None.

    ``options`` are the chat options (``tools``, ``tool_choice``, ``parallel_tool_calls``,
    ``response_format``) already checked by :func:`check_tool_choice` / :func:`check_response_format`.
    """
    tool_choice = options.get("tool_choice")
    if is_forced_tool_choice(tool_choice):
        schema = forced_tool_call_schema(options.get("tools") or (), tool_choice, options.get("parallel_tool_calls"))
        return StructuredOutput(json_schema=schema, strict=True, param="tools")
    fmt = options.get("response_format")
    kind = fmt.get("type", "text") if isinstance(fmt, Mapping) else "text"
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind == "json_schema":
        spec = fmt["json_schema"]
        return StructuredOutput(json_schema=spec["schema"], strict=spec.get("strict"))
    return None


def tool_calls_as_text(messages: Sequence[Any]) -> list[Any]:
    """Assistant turns with ``tool_calls`` and no content, rewritten for a template that has no tool syntax.

    Such a turn is what a forced call returned; its content becomes the JSON array the grammar made the model
    write (``[{"name": ..., "arguments": {...}}]``), so replaying it shows the model its own words. Other
    messages, and the caller's objects, are left as they are (changed turns are copies).
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, Mapping) else None
        if not calls or message.get("role") != "assistant" or message.get("content") or not _is_list(calls):
            out.append(message)
            continue
        written = []
        for call in calls:
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                raise InvalidRequestError("an assistant tool call has no function object", param="messages")
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    pass
            written.append({"name": function.get("name"), "arguments": arguments})
        copy = {k: v for k, v in message.items() if k != "tool_calls"}
        copy["content"] = json.dumps(written, ensure_ascii=False)
        out.append(copy)
    return out


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def after_reasoning(structured: StructuredOutput | None, chat_output: Any) -> StructuredOutput | None:
    """``structured`` made to start after a thinking model's reasoning block.

    ``chat_output`` is the request's ``ChatOutputSpec`` (None for a model that writes plain text): when the
    prompt opened the block the output is free until its end marker; when the model may open it, its first
    token may do so; when the prompt closed it, the grammar applies from the first token.
    """
    reasoning = getattr(chat_output, "reasoning", None)
    if structured is None or reasoning is None or chat_output.reasoning_state == ANSWER:
        return structured
    return dataclasses.replace(structured, reasoning=(reasoning.start, reasoning.end),
                               in_reasoning=chat_output.reasoning_state == INSIDE)


def parse_forced_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` from a forced answer (a JSON array of ``{"name", "arguments"}``), or None.

    All or nothing: text that is not a complete, well-formed array of calls (e.g. cut at the token budget)
    yields None and stays the message's content.
    """
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    if not isinstance(calls, list) or not calls:
        return None
    out = []
    for call in calls:
        if (not isinstance(call, dict) or not isinstance(call.get("name"), str)
                or not isinstance(call.get("arguments"), dict)):
            return None
        out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                    "function": {"name": call["name"],
                                 "arguments": json.dumps(call["arguments"], ensure_ascii=False)}})
    return out
