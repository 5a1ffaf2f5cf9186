"""Chat-template rendering in a sandboxed Jinja environment, matching transformers' apply_chat_template."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pocketllm.errors import CheckpointError, InvalidRequestError

__all__ = ["VALID_ROLES", "check_tool_replies", "normalize_messages", "render_chat_template",
           "template_supports_tools"]

VALID_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})

# Names a message may carry its reasoning under; templates read the first (transformers aliases them all).
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


# ----------------------------------------------------------------------------------------------------
# Template environment
# ----------------------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    """Template helper: refuse the request with the template's own message."""
    raise InvalidRequestError(f"chat template: {message}", param="messages")


def _strftime_now(fmt: str) -> str:
    """Template helper: the current local time formatted with ``fmt``."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON filter without Jinja's HTML escaping, with json.dumps' layout options."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _DictFactory:
    """The ``dict`` global: builds plain dicts without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        """Return ``dict(*args, **kwargs)``."""
        return dict(*args, **kwargs)

    def fromkeys(self, keys: Any, value: Any = None) -> dict:
        """Return ``dict.fromkeys(keys, value)``."""
        return dict.fromkeys(keys, value)


def _check_namespace_name(name: Any) -> None:
    """Refuse underscore-prefixed namespace attributes (a path towards interpreter internals)."""
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"chat templates may not set namespace attribute {name!r}")


class _SafeNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` that refuses underscore-prefixed attribute names."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        """Create the namespace; ``self`` is taken positionally so ``namespace(self=...)`` still works."""
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        """Set an attribute (``{% set ns.x = ... %}``) after checking its name."""
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationTag(Extension):
    """``{% generation %}`` blocks render their body unchanged (transformers uses them for masks)."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        """Parse the block and return its body as-is."""
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    """The one sandboxed environment every template is compiled in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _SafeNamespace
    return env


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    """Compile a chat template once per distinct template string."""
    try:
        return _environment().from_string(template)
    except jinja2.TemplateSyntaxError as exc:
        raise CheckpointError(f"chat template does not compile: {exc}") from exc


@lru_cache(maxsize=64)
def template_supports_tools(template: str) -> bool:
    """Whether the template reads the ``tools`` variable (a template that ignores it cannot offer tools)."""
    return "tools" in jinja2.meta.find_undeclared_variables(_compile(template).environment.parse(template))


# ----------------------------------------------------------------------------------------------------
# Message normalisation (always on private copies)
# ----------------------------------------------------------------------------------------------------


def _plain(value: Any, where: str) -> Any:
    """Deep-copy ``value`` into plain JSON types (dict, list, str, numbers, None); refuse anything else."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(key, where): _plain(item, where) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item, where) for item in value]
    raise InvalidRequestError(f"{where} may hold only JSON values, not {type(value).__name__}", param=where)


class _JsonArguments(dict):
    """Tool-call arguments parsed from JSON: a mapping to templates that iterate over them, and the caller's
    JSON text to templates that print or concatenate them (``str()``, ``~``, ``+`` with a string)."""

    __slots__ = ("_source",)

    def __init__(self, parsed: dict, source: str) -> None:
        """Wrap the parsed object and remember the caller's text."""
        super().__init__(parsed)
        self._source = source

    def __str__(self) -> str:
        """The JSON text as sent."""
        return self._source

    def __add__(self, other: Any) -> Any:
        """``arguments + "text"``."""
        return self._source + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        """``"text" + arguments``."""
        return other + self._source if isinstance(other, str) else NotImplemented


def _flatten_content(content: Any, role: str) -> Any:
    """Flatten a list of OpenAI text parts (and, in an assistant message, refusal parts: what it said) into one
    string; refuse any other part."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError("message content must be a string or a list of parts", param="messages")
    if not content:
        raise InvalidRequestError("message content is an empty array: send at least one part, or a string",
                                  param="messages")
    texts = []
    for part in content:
        if not isinstance(part, dict):
            raise InvalidRequestError("each content part must be an object", param="messages")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise InvalidRequestError('each content part needs a "type" (for text: {"type": "text", "text": ...})',
                                      param="messages")
        field = "refusal" if kind == "refusal" and role == "assistant" else "text"
        if kind != field:
            raise InvalidRequestError(
                f"this model takes text only; content part type {kind!r} is not supported", param="messages"
            )
        if not isinstance(part.get(field), str):
            raise InvalidRequestError(f"a {kind} content part needs a string {field!r}", param="messages")
        texts.append(part[field])
    return "".join(texts)


def _parse_arguments(arguments: Any) -> Any:
    """Hand JSON-object argument strings to the template as a mapping; leave anything else as it is."""
    if not isinstance(arguments, str):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return _JsonArguments(parsed, arguments) if isinstance(parsed, dict) else arguments


def _check_tool_call(call: Mapping) -> None:
    """An assistant's tool call: a string ``id`` where it has one, a function object with a string name."""
    function = call.get("function")
    if function is not None and not (isinstance(function, Mapping) and isinstance(function.get("name"), str)):
        raise InvalidRequestError('a tool call\'s "function" must be an object with a string "name"', param="messages")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise InvalidRequestError('a tool call\'s "id" must be a string', param="messages")


def _normalize_tool_calls(tool_calls: Any) -> list:
    """Validate an assistant's tool calls and parse their JSON-string arguments."""
    if not isinstance(tool_calls, list):
        raise InvalidRequestError("tool_calls must be a list", param="messages")
    for call in tool_calls:
        if not isinstance(call, dict):
            raise InvalidRequestError("each tool call must be an object", param="messages")
        _check_tool_call(call)
        function = call.get("function")
        if isinstance(function, dict) and "arguments" in function:
            function["arguments"] = _parse_arguments(function["arguments"])
    return tool_calls


def _alias_reasoning(message: dict) -> dict:
    """Expose a message's reasoning under every name templates read, as transformers does."""
    reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _normalize_message(message: Any) -> dict:
    """Return a normalised private copy of one message."""
    if not isinstance(message, Mapping):
        raise InvalidRequestError("each message must be an object", param="messages")
    role = message.get("role")
    if role not in VALID_ROLES:
        raise InvalidRequestError(
            f"message role must be one of {', '.join(sorted(VALID_ROLES))}, not {role!r}", param="messages"
        )
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise InvalidRequestError(f'a message\'s "{key}" must be a string', param="messages")
    copy = _plain(message, "messages")
    keep_none_content = role == "assistant" and bool(copy.get("tool_calls"))
    # Keys set to None are dropped (as transformers does), except an assistant's null content beside
    # tool calls, which templates such as DeepSeek-R1's test with `content is none`.
    copy = {k: v for k, v in copy.items() if v is not None or (k == "content" and keep_none_content)}
    if "content" in copy:
        copy["content"] = _flatten_content(copy["content"], role)
    if role == "assistant":
        refusal = copy.pop("refusal", None)
        if refusal is not None and not isinstance(refusal, str):
            raise InvalidRequestError('an assistant message\'s "refusal" must be a string', param="messages")
        if copy.get("content") is None and refusal is not None:   # a refusal returned by the API is what it said
            copy["content"] = refusal
    if "tool_calls" in copy:
        copy["tool_calls"] = _normalize_tool_calls(copy["tool_calls"])
    return _alias_reasoning(copy)


def normalize_messages(messages: Sequence[Mapping]) -> list[dict]:
    """Validate messages; return private template-ready copies (the caller's objects are never touched)."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise InvalidRequestError("messages must be a list of message objects", param="messages")
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    return [_normalize_message(message) for message in messages]


def check_tool_replies(messages: Sequence[Any]) -> None:
    """A caller's conversation, before any rewriting: each tool message answers a call of the assistant message
    before it (other tool replies between) and names that call's id in ``tool_call_id`` when the calls carry
    ids. (Malformed messages are left to ``normalize_messages``.)"""
    calls: list | None = None   # the tool calls open for replies
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        if role == "assistant":
            tool_calls = message.get("tool_calls")
            calls = [c for c in tool_calls if isinstance(c, Mapping)] if isinstance(tool_calls, list) else []
            for call in calls:
                _check_tool_call(call)
            calls = calls or None
        elif role == "tool":
            if calls is None:
                raise InvalidRequestError("a message with role 'tool' must answer a tool call of the assistant "
                                          "message before it", param="messages")
            reply_to = message.get("tool_call_id")
            if reply_to is not None and not isinstance(reply_to, str):
                raise InvalidRequestError('a message\'s "tool_call_id" must be a string', param="messages")
            if not reply_to:
                raise InvalidRequestError("a message with role 'tool' needs the \"tool_call_id\" of the call it "
                                          "answers", param="messages")
            ids = [call.get("id") for call in calls if call.get("id") is not None]
            if ids and reply_to not in ids:
                raise InvalidRequestError(f"tool_call_id {reply_to!r} is not among the tool calls of the assistant "
                                          f"message before it ({', '.join(map(repr, ids))})", param="messages")
        else:
            calls = None


def _normalize_tools(tools: Sequence[Mapping] | None) -> list | None:
    """Private plain copy of the tool definitions."""
    if tools is None:
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise InvalidRequestError("tools must be a list of tool objects", param="tools")
    if not all(isinstance(tool, Mapping) for tool in tools):
        raise InvalidRequestError("each tool must be an object", param="tools")
    return _plain(tools, "tools")


# ----------------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------------


def render_chat_template(
    template: str,
    messages: Sequence[Mapping],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping] | None = None,
    special_tokens: Mapping[str, str | None] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render ``messages`` with a checkpoint's chat template, as ``tokenizer.apply_chat_template`` would."""
    compiled = _compile(template)
    normalized = normalize_messages(messages)
    context: dict[str, Any] = {k: str(v) for k, v in (special_tokens or {}).items() if v is not None}
    context.update(_plain(template_kwargs, "template_kwargs"))
    context.update(
        messages=normalized,
        tools=_normalize_tools(tools),
        documents=context.get("documents"),
        add_generation_prompt=add_generation_prompt,
    )
    try:
        return compiled.render(context)
    except InvalidRequestError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        message = f"the chat template cannot render these messages: {exc}"
        missing = next((i for i, m in enumerate(normalized) if m.get("content") is None), None)
        if missing is not None and "content" in str(exc):
            role = normalized[missing]["role"]
            message = (f'messages[{missing}] (role {role!r}) has no "content", which this model\'s chat template '
                       "needs: send a string or an array of text parts")
        raise InvalidRequestError(message, param="messages") from exc
