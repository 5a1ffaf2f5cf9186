"""The OpenAI request-field policy of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``, and the
parsers of the first two (``responses_request`` parses the third).

A request field is accepted only when the server acts on it. ``FIELD_POLICY`` is the one table that says,
for every documented OpenAI field of the endpoints (and PocketLLM's own extensions), which of three groups
it falls in:

- ``implemented``: acted on; the value is validated (type and range) and handed to the engine.
- ``refused_at_value``: this server cannot do what the field asks, so any value but the one naming what the
  server already does (``rule.neutral``) is a 400 that says what happens instead and what to send.
- ``inert``: cannot change the generated text; type-checked and ignored.

A field in no row is a 400 naming it. Every refusal is an ``InvalidRequestError`` whose ``param`` is the
offending field. The parser returns a ``ParsedRequest``: the messages or prompts, the keyword arguments for
``SamplingParams``, and the chat options for the chat builder. It imports no torch and nothing below the
facade: ``caps`` is any object with ``EngineCaps``' attributes (absent ones take permissive defaults,
except ``structured_outputs``, which defaults to off).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_request import REASONING_EFFORTS
from pocketllm.protocol.structured_output import check_response_format, check_tool_choice
from pocketllm.sampling_params import MAX_LOGPROBS, SEED_RANGE, SamplingParams

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "FIELD_POLICY",
    "RESPONSES",
    "IMPLEMENTED",
    "INERT",
    "MAX_N",
    "REFUSED_AT_VALUE",
    "FieldRule",
    "ParsedRequest",
    "parse_chat_request",
    "parse_completion_request",
]

CHAT = "chat"
COMPLETIONS = "completions"
RESPONSES = "responses"
IMPLEMENTED = "implemented"
REFUSED_AT_VALUE = "refused_at_value"
INERT = "inert"

MAX_N = 128
MAX_STOP = 64                 # stop strings a request may send
MAX_STOP_CHARS = 1024         # characters in one stop string
MAX_JSON_DEPTH = 64           # nesting of a request body's values
MAX_METADATA_KEYS = 16        # metadata pairs, with OpenAI's limits on their keys and values below
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_CHOICES = 2048            # prompts times n in one completions request
SERVICE_TIERS = ("auto", "default")  # the one tier served here, by OpenAI's two names for it
_OTHER_TIERS = ("flex", "scale", "priority")
_ANY_VOCAB = 2**31            # token ids are below this when the engine does not declare its vocabulary
_PATHS = {CHAT: "/v1/chat/completions", COMPLETIONS: "/v1/completions", RESPONSES: "/v1/responses"}
_TEMPLATE_RESERVED = ("messages", "tools", "add_generation_prompt", "special_tokens", "documents")
_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_REQUEST_ID = 256
_MAX_ID_DIGITS = 18                  # a longer token id is outside every vocabulary (and is not converted)
_BEYOND_ANY_VOCABULARY = 10**18


@dataclass(frozen=True)
class FieldRule:
    """One row of the policy table.

    ``neutral`` (refused-at-value rows): the values accepted because they name what the server already
    does; any other value is refused with ``reason`` (what the server does instead) and ``advice`` (what to
    send). ``extension`` marks PocketLLM/vLLM fields that OpenAI does not define.
    """

    kind: str
    summary: str
    extension: bool = False
    neutral: tuple[Any, ...] = ()
    reason: str = ""
    advice: str = ""


def _impl(summary: str, extension: bool = False) -> FieldRule:
    return FieldRule(IMPLEMENTED, summary, extension=extension)


def _inert(summary: str) -> FieldRule:
    return FieldRule(INERT, summary, neutral=(None,))


def _refused(summary: str, neutral: tuple[Any, ...], reason: str, advice: str) -> FieldRule:
    return FieldRule(REFUSED_AT_VALUE, summary, neutral=neutral, reason=reason, advice=advice)


# Rows both endpoints share, then each endpoint's own.
_SHARED: dict[str, FieldRule] = {
    "max_tokens": _impl("the generation budget in tokens; absent means the rest of the context"),
    "temperature": _impl("sampling temperature in 0..2; 0 is greedy"),
    "top_p": _impl("nucleus sampling mass in (0, 1]"),
    "seed": _impl("seeds the request's sampler (choice i of n gets a seed derived from it)"),
    "n": _impl(f"number of choices, 1..{MAX_N}; each choice is its own scheduler request"),
    "stop": _impl("string or list of strings matched on the decoded text; empty strings are dropped"),
    "stream": _impl("server-sent event deltas terminated by [DONE]"),
    "frequency_penalty": _impl("penalty per prior occurrence of a token, in -2..2"),
    "presence_penalty": _impl("penalty for a token having occurred at all, in -2..2"),
    "logit_bias": _impl("token id -> bias in -100..100 added to the logits"),
    "stream_options": _refused(
        "streaming options: include_usage true adds a last chunk with the usage and no choices (every other "
        "chunk carries \"usage\": null); accepted on a non-streaming response, which reports usage anyway",
        (None, {}, {"include_usage": False}, {"include_usage": True}),
        "a stream carries no obfuscation padding",
        'Send "include_obfuscation": false or omit it'),
    "user": _inert("end-user identifier; cannot change the text"),
    "model": _inert("the server serves one model and echoes its configured name"),
    # PocketLLM / vLLM extensions.
    "top_k": _impl("keep the k most likely tokens; 0 or -1 is off", extension=True),
    "min_p": _impl("drop tokens below min_p times the top probability, in 0..1", extension=True),
    "repetition_penalty": _impl("multiplicative penalty on prior tokens, > 0; 1 is off", extension=True),
    "ignore_eos": _impl("keep generating past EOS until the budget or a stop", extension=True),
    "stop_token_ids": _impl("token ids that end the request like EOS", extension=True),
    "request_id": _impl("caller-chosen id, usable with DELETE /v1/requests/<id>", extension=True),
}

_CHAT_ONLY: dict[str, FieldRule] = {
    "messages": _impl("the conversation, rendered by the checkpoint's own chat template"),
    "max_completion_tokens": _impl("the generation budget; wins over max_tokens when both are sent"),
    "logprobs": _impl("boolean: report the sampled token's log probability (streamed chunks carry those of "
                      "their tokens)"),
    "top_logprobs": _impl(f"0..{MAX_LOGPROBS} alternatives ranked per position; needs logprobs=true"),
    "response_format": _impl("text, json_object or json_schema; the answer is constrained by a grammar (needs "
                             "structured outputs)"),
    "tools": _impl("function tool definitions passed to the chat template; calls parsed back"),
    "reasoning_effort": _impl(f"reasoning effort for the template ({', '.join(REASONING_EFFORTS)})"),
    "tool_choice": _impl("auto; none (tools kept out of the template); required or a named function, which "
                         "constrain the answer to calls of the tools by a grammar (needs structured outputs)"),
    "parallel_tool_calls": _impl("true is inert; false holds a forced call (required / named) to one call, and is "
                                 "refused with tool_choice auto, where the model's own syntax is not limited"),
    "audio": _refused(
        "audio output parameters", (None,),
        "this server generates text only and produces no audio",
        'Omit "audio" or send null'),
    "modalities": _refused(
        "output modalities", (None, ["text"]),
        "this server generates text only",
        'Send "modalities": ["text"] or omit it'),
    "prediction": _refused(
        "predicted output content", (None,),
        "predicted outputs are not used: there is no decoding path that verifies a caller's draft",
        'Omit "prediction" or send null'),
    "web_search_options": _refused(
        "web search tool options", (None,),
        "the model has no web search tool, so nothing would be searched",
        'Omit "web_search_options" or send null'),
    "functions": _refused(
        "deprecated function definitions", (None, []),
        "the deprecated functions interface is not implemented",
        'Send the definitions as "tools": [{"type": "function", "function": {...}}]'),
    "function_call": _refused(
        "deprecated function-call policy", (None,),
        "the deprecated function_call policy is not implemented",
        'Omit "function_call" and use "tools" with "tool_choice"'),
    "verbosity": _refused(
        "answer verbosity level", (None,),
        "the answer's length is not steered by a verbosity level",
        'Omit "verbosity"; bound the length with "max_completion_tokens"'),
    "moderation": _refused(
        "moderation of the input and output", (None,),
        "no moderation model runs on the input or the output, so nothing would be scored or blocked",
        'Omit "moderation" or send null'),
    "store": _refused(
        "store the completion for later retrieval", (None, False),
        "this server keeps no completions: nothing could be listed or retrieved later",
        'Send "store": false or omit it'),
    "metadata": _inert(f"caller tags (at most {MAX_METADATA_KEYS} string values); cannot change the text"),
    "service_tier": _inert("processing tier, auto or default: one tier here, and it cannot change the text"),
    "prompt_cache_key": _inert("prompt-cache bucketing hint; prefix caching is automatic"),
    "prompt_cache_retention": _inert("prompt-cache lifetime; cannot change the text"),
    "prompt_cache_options": _inert("prompt-cache breakpoints and lifetime; cannot change the text"),
    "safety_identifier": _inert("end-user identifier for abuse detection; cannot change the text"),
    # PocketLLM extensions.
    "thinking_mode": _impl("turn the template's thinking switch on or off", extension=True),
    "add_generation_prompt": _impl("end the rendered prompt with the assistant turn opener", extension=True),
    "drop_thinking": _impl("leave the reasoning block out of the returned message", extension=True),
    "chat_template_kwargs": _impl("extra variables for the chat template", extension=True),
}

_COMPLETIONS_ONLY: dict[str, FieldRule] = {
    "prompt": _impl("a string, a list of strings, a list of token ids, or a list of token-id lists"),
    "logprobs": _impl(f"whole number 0..{MAX_LOGPROBS}: alternatives ranked per position (streamed chunks carry "
                      "those of their tokens)"),
    "best_of": _refused(
        "server-side candidates to pick the best from", (None, 1),
        "one candidate is generated per choice; there is no second candidate to compare it against",
        'Send "best_of": 1 or omit it; ask for more choices with "n"'),
    "suffix": _refused(
        "text after the insertion point", (None, ""),
        "the completion is returned on its own, with no suffix appended (there is no fill-in-the-middle)",
        'Send "suffix": "" or omit it'),
    "echo": _refused(
        "echo the prompt before the completion", (None, False),
        "the text holds only the generated continuation, never the prompt",
        'Send "echo": false or omit it'),
    "top_logprobs": _refused(
        "chat's count of alternatives", (None,),
        'on /v1/completions the number of alternatives is "logprobs" itself',
        'Send the count as "logprobs" and omit "top_logprobs"'),
}

# /v1/responses: the conversation is "input" (plus "instructions"), run through the chat path.
_RESPONSES: dict[str, FieldRule] = {
    "input": _impl("a string (one user message) or a list of items: messages (text content parts), function_call "
                   "and function_call_output items, reasoning items; rendered by the checkpoint's chat template"),
    "instructions": _impl("a system message put before the input"),
    "tools": _impl("function tools in the Responses shape ({type, name, description, parameters, strict}); calls "
                   "parsed back as function_call items"),
    "tool_choice": _impl('auto, none, required or {"type": "function", "name": ...}, as on chat (a forced call is '
                         "constrained by a grammar)"),
    "parallel_tool_calls": _impl("true is inert; false holds a forced call to one call (refused with auto)"),
    "text": _impl('{"format": ...}: text, json_object or json_schema ({name, schema, strict}), constrained by a '
                  "grammar as chat's response_format; verbosity is refused"),
    "reasoning": _impl("effort, mapped to the template's own spelling as chat's reasoning_effort; summaries are "
                       "refused"),
    "max_output_tokens": _impl("the generation budget in tokens; absent means the rest of the context"),
    "temperature": _impl("sampling temperature in 0..2; 0 is greedy"),
    "top_p": _impl("nucleus sampling mass in (0, 1]"),
    "stream": _impl("server-sent typed events (response.created ... response.completed), each with a "
                    "sequence_number"),
    "store": _refused(
        "store the response for later retrieval", (None, False),
        "this server keeps no responses: nothing could be retrieved or continued later",
        'Send "store": false (or omit it) and pass the conversation in "input"'),
    "previous_response_id": _refused(
        "continue from a stored response", (None,),
        "this server stores no responses, so there is no earlier response to continue from",
        'Omit "previous_response_id" and send the earlier turns (with their output items) in "input"'),
    "conversation": _refused(
        "a stored conversation to add to", (None,),
        "this server stores no conversations",
        'Omit "conversation" and send the earlier turns in "input"'),
    "background": _refused(
        "run the response in the background", (None, False),
        "responses run while the request is open; there is no stored response to poll",
        'Send "background": false or omit it'),
    "background_options": _refused(
        "options of a background response", (None,),
        "responses never run in the background here",
        'Omit "background_options"'),
    "include": _refused(
        "extra output data to include", (None, []),
        "none of the optional output data (log probabilities, encrypted reasoning, tool sources) is produced",
        'Send "include": [] or omit it'),
    "top_logprobs": _refused(
        "alternatives per position in the output's log probabilities", (None, 0),
        "the Responses output carries no log probabilities here",
        'Send "top_logprobs": 0 or omit it; /v1/chat/completions returns log probabilities'),
    "prompt": _refused(
        "a stored prompt template", (None,),
        "this server stores no prompt templates",
        'Omit "prompt" and send the text in "instructions" and "input"'),
    "truncation": _refused(
        "drop early input items that do not fit the context", (None, "disabled"),
        "input that does not fit the context is refused, never cut",
        'Send "truncation": "disabled" or omit it, and shorten the input'),
    "context_management": _refused(
        "server-side compaction of the context", (None, []),
        "the context is never compacted here",
        'Omit "context_management" or send []'),
    "moderation": _refused(
        "moderation of the input and output", (None,),
        "no moderation model runs on the input or the output, so nothing would be scored or blocked",
        'Omit "moderation" or send null'),
    "stream_options": _refused(
        "streaming options", (None, {}, {"include_obfuscation": False}),
        "a stream carries no obfuscation padding",
        'Send "include_obfuscation": false or omit it'),
    "access_programs": _refused(
        "domain-specific access programs", (None,),
        "this server has no access programs",
        'Omit "access_programs"'),
    "image": _refused(
        "request-level image options", (None,),
        "this server reads and writes text only",
        'Omit "image"'),
    "model": _inert("the server serves one model and echoes its configured name"),
    "user": _inert("end-user identifier; cannot change the text"),
    "metadata": _inert(f"caller tags (at most {MAX_METADATA_KEYS} string values), echoed in the response; cannot "
                       "change the text"),
    "service_tier": _inert("processing tier, auto or default: one tier here, and it cannot change the text"),
    "safety_identifier": _inert("end-user identifier for abuse detection; cannot change the text"),
    "prompt_cache_key": _inert("prompt-cache bucketing hint; prefix caching is automatic"),
    "prompt_cache_retention": _inert("prompt-cache lifetime; cannot change the text"),
    "prompt_cache_options": _inert("prompt-cache breakpoints and lifetime; cannot change the text"),
    "max_tool_calls": _inert("a bound on built-in tool calls; no built-in tool runs here"),
}

FIELD_POLICY: dict[str, dict[str, FieldRule]] = {
    CHAT: dict(sorted({**_SHARED, **_CHAT_ONLY}.items())),
    COMPLETIONS: dict(sorted({**_SHARED, **_COMPLETIONS_ONLY}.items())),
    RESPONSES: dict(sorted(_RESPONSES.items())),
}


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: what the faces hand to the facade."""

    endpoint: str
    messages: list | None
    prompts: list[str | list[int]] | None
    sampling: dict[str, Any]
    n: int
    stream: bool
    want_logprobs: bool
    chat_options: dict[str, Any]
    request_id: str | None
    drop_thinking: bool | None
    include_usage: bool = False       # stream_options.include_usage on a stream: a last chunk with the usage


# ----------------------------------------------------------------------------------------------------
# Messages and value checks
# ----------------------------------------------------------------------------------------------------


def show_value(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def unsupported_field(field: str, value: Any, reason: str, advice: str) -> InvalidRequestError:
    return InvalidRequestError(
        f'"{field}" = {show_value(value)} is not supported by this server: {reason}. {advice}.', param=field)


def invalid_field(field: str, value: Any, expected: str, advice: str | None = None) -> InvalidRequestError:
    advice = advice or f'Send "{field}" as {expected}, or omit it'
    return InvalidRequestError(f'"{field}" = {show_value(value)} is not valid here: it must be {expected}. {advice}.',
                               param=field)


def _json_equal(a: Any, b: Any) -> bool:
    """Equality as JSON sees it: booleans are not numbers, 1 equals 1.0."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if is_list(a) and is_list(b):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))


def whole_number(field: str, value: Any, low: int | None, high: int | None, what: str,
                 advice: str | None = None) -> int:
    """A whole number (an integral float such as 2.0 counts) in [low, high]."""
    number: int | None = None
    if not isinstance(value, bool):
        if isinstance(value, int):
            number = value
        elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
            number = int(value)
    if number is None or (low is not None and number < low) or (high is not None and number > high):
        raise invalid_field(field, value, what, advice)
    return number


def _finite(value: Any) -> bool:
    """A JSON number a float holds: finite, and not an integer too large for a float (10**400 is refused)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _real(field: str, value: Any, low: float, high: float | None, what: str, low_open: bool = False) -> float:
    ok = (_finite(value) and (value > low if low_open else value >= low) and (high is None or value <= high))
    if not ok:
        raise invalid_field(field, value, what)
    return float(value)


def _boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise invalid_field(field, value, "true or false")
    return value


def _string(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise invalid_field(field, value, "a string")
    return value


def object_field(field: str, value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise invalid_field(field, value, "a JSON object")
    return value


def _count(field: str, value: Any) -> int:
    return whole_number(field, value, 0, None, "a whole number >= 0")


def _metadata(field: str, value: Any) -> Mapping[str, str]:
    """Caller tags as OpenAI takes them: at most 16 pairs, keys up to 64 characters, string values up to 512."""
    tags = object_field(field, value)
    if len(tags) > MAX_METADATA_KEYS or not all(
            isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS
            for k, v in tags.items()):
        raise invalid_field(field, value, f"an object of at most {MAX_METADATA_KEYS} pairs, each key at most "
                            f"{MAX_METADATA_KEY_CHARS} characters and each value a string of at most "
                            f"{MAX_METADATA_VALUE_CHARS}")
    return tags


def _service_tier(field: str, value: Any) -> str:
    """``auto`` or ``default``: the one tier served here; the tiers this server does not have are refused."""
    if value in _OTHER_TIERS:
        raise unsupported_field(field, value, f"this server has one processing tier, with no {', '.join(_OTHER_TIERS)} "
                                "processing", 'Send "service_tier": "auto" or "default", or omit it')
    if value not in SERVICE_TIERS:
        raise invalid_field(field, value, "one of " + ", ".join(f'"{t}"' for t in SERVICE_TIERS + _OTHER_TIERS))
    return value


_INERT_TYPES: dict[str, Any] = {
    "model": _string, "user": _string, "store": _boolean, "metadata": _metadata, "service_tier": _service_tier,
    "prompt_cache_key": _string, "prompt_cache_retention": _string, "prompt_cache_options": object_field,
    "safety_identifier": _string, "max_tool_calls": _count,
}


# ----------------------------------------------------------------------------------------------------
# Capabilities
# ----------------------------------------------------------------------------------------------------

_CAP_DEFAULTS = {"per_request_sampling": True, "per_request_top_k": True, "logprobs": True,
                 "max_logprobs": MAX_LOGPROBS, "penalties": True, "logit_bias": True, "structured_outputs": False}
_SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)
                      if f.name in ("temperature", "top_p", "top_k", "min_p", "seed")}


def _cap(caps: Any, name: str) -> Any:
    return getattr(caps, name, _CAP_DEFAULTS[name]) if caps is not None else _CAP_DEFAULTS[name]


def _torch_backend_advice(caps: Any) -> str:
    """Advice for a feature the native plane lacks and the Torch backend has: how to get it."""
    details = getattr(caps, "details", None)
    if isinstance(details, Mapping) and details.get("backend") == "cpp":
        return " (this model runs on the native plane; a server started with backend='torch' has it)"
    return ""


def vocab_size_of(caps: Any) -> int:
    """The engine's vocabulary size (``caps.details['vocab_size']``), or a bound every token id is under."""
    details = getattr(caps, "details", None)
    size = details.get("vocab_size") if isinstance(details, Mapping) else None
    return size if isinstance(size, int) and size > 0 else _ANY_VOCAB


def _engine_sampling(caps: Any) -> dict[str, Any]:
    """The engine's effective sampling values: ``caps.details['sampling_defaults']`` over SamplingParams'."""
    details = getattr(caps, "details", None)
    declared = details.get("sampling_defaults") if isinstance(details, Mapping) else None
    return {**_SAMPLING_DEFAULTS, **(declared if isinstance(declared, Mapping) else {})}


def check_caps(body: Mapping[str, Any], sampling: dict[str, Any], n: int, caps: Any) -> None:
    if not _cap(caps, "per_request_sampling"):
        fixed = _engine_sampling(caps)
        for name in ("temperature", "top_p", "min_p", "seed"):
            if name in sampling and not _json_equal(sampling[name], fixed[name]):
                raise unsupported_field(name, body[name],
                                   f"this engine fixes its sampling engine-wide ({name} {show_value(fixed[name])}) "
                                   "and cannot apply a per-request value",
                                   f'Omit "{name}" or send {show_value(fixed[name])}')
        if n > 1 and fixed["temperature"] != 0:
            raise unsupported_field("n", body["n"],
                               "this engine fixes its sampling engine-wide, so every choice would be the same "
                               "draw rather than an independent sample",
                               'Send "n": 1 and repeat the request for more answers')
    if not _cap(caps, "per_request_top_k") and "top_k" in sampling:
        fixed_k = _engine_sampling(caps)["top_k"]
        fixed_k = 0 if fixed_k == -1 else fixed_k
        if sampling["top_k"] != fixed_k:
            raise unsupported_field("top_k", body["top_k"],
                               f"this engine fixes top-k engine-wide (top_k {fixed_k}) and cannot apply a "
                               "per-request value", f'Omit "top_k" or send {fixed_k}')
    if not _cap(caps, "penalties"):
        for name, neutral in (("frequency_penalty", 0.0), ("presence_penalty", 0.0), ("repetition_penalty", 1.0)):
            if name in sampling and sampling[name] != neutral:
                raise unsupported_field(name, body[name], "this engine applies no repetition or presence penalty",
                                   f'Omit "{name}" or send {show_value(neutral)}')
    if not _cap(caps, "logit_bias") and sampling.get("logit_bias"):
        raise unsupported_field("logit_bias", body["logit_bias"], "this engine applies no per-token bias",
                           'Omit "logit_bias" or send {}')


def _check_logprobs_caps(count_field: str, count: int, caps: Any, value: Any) -> None:
    """``value`` is what the request sent for ``logprobs``; ``count`` the alternatives it asks for."""
    if not _cap(caps, "logprobs"):
        raise unsupported_field("logprobs", value, "this engine does not rank tokens (its capabilities declare no "
                           "log probabilities)", 'Omit "logprobs"')
    ceiling = _cap(caps, "max_logprobs")
    if count > ceiling:
        raise unsupported_field(count_field, count, f"this engine ranks at most {ceiling} alternatives per position",
                           f'Send "{count_field}" of at most {ceiling}')


# ----------------------------------------------------------------------------------------------------
# Shared field parsing
# ----------------------------------------------------------------------------------------------------


def present_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body's fields that are not null (null means absent for every optional field)."""
    return {k: v for k, v in body.items() if v is not None}


def check_known_fields(body: Mapping[str, Any], endpoint: str) -> None:
    table = FIELD_POLICY[endpoint]
    for name in body:
        if name in table:
            continue
        others = [_PATHS[other] for other in FIELD_POLICY if other != endpoint and name in FIELD_POLICY[other]]
        hint = f' ("{name}" is a field of {" and ".join(others)})' if others else ""
        shown = name if isinstance(name, str) else repr(name)
        raise InvalidRequestError(
            f'"{shown}" is not a request field of {_PATHS[endpoint]} that this server knows{hint}, so it '
            f'cannot act on it. Remove "{shown}" from the request.', param=str(name))


def check_refused_rows(fields: Mapping[str, Any], endpoint: str) -> None:
    for name, value in fields.items():
        rule = FIELD_POLICY[endpoint][name]
        if rule.kind == INERT:
            _INERT_TYPES[name](name, value)
        elif rule.kind == REFUSED_AT_VALUE and (name != "stream_options" or endpoint == RESPONSES):
            if not any(_json_equal(value, ok) for ok in rule.neutral):
                raise unsupported_field(name, value, rule.reason, rule.advice)


def _stream_options(value: Any, stream: bool) -> bool:
    """Whether a stream ends with a usage chunk (``include_usage``); padding (``include_obfuscation``) is refused."""
    options = object_field("stream_options", value)
    include_usage = False
    for key, flag in options.items():
        if key not in ("include_usage", "include_obfuscation"):
            raise unsupported_field("stream_options", value, f'"{key}" is not a stream option this server knows',
                               'Send only "include_usage" and "include_obfuscation" (false)')
        if flag is None:
            continue
        if not isinstance(flag, bool):
            raise invalid_field("stream_options", value, f"an object whose {key} is true or false")
        if key == "include_usage":
            include_usage = flag and stream
        elif flag and stream:
            raise unsupported_field("stream_options", value, "a stream carries no obfuscation padding",
                               'Send "include_obfuscation": false or omit it')
    return include_usage


def _stop(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items: list[str] = [value]
    elif is_list(value) and all(isinstance(s, str) for s in value):
        items = list(value)
    else:
        raise unsupported_field("stop", value,
                           "a stop sequence is a string, or a list of strings, and this value is neither",
                           'Send "stop" as a string or an array of strings')
    if len(items) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in items):
        raise invalid_field("stop", value, f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters each")
    return tuple(s for s in items if s)


def _canonical_id(key: Any) -> int | None:
    """A token id written as JSON writes one: an int, or a string of ASCII digits without a leading zero."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key if key >= 0 else None
    if isinstance(key, str) and key.isascii() and key.isdigit() and (key == "0" or key[0] != "0"):
        return int(key) if len(key) <= _MAX_ID_DIGITS else _BEYOND_ANY_VOCABULARY
    return None


def _logit_bias(value: Any, vocab_size: int) -> dict[int, float]:
    bias = object_field("logit_bias", value)
    clean: dict[int, float] = {}
    for key, weight in bias.items():
        token = _canonical_id(key)
        if token is None:
            raise invalid_field("logit_bias", value, "an object mapping token ids (as strings) to numbers in -100..100",
                           f"The key {show_value(key)} is not a token id; send token ids (whole numbers >= 0 in ASCII "
                           "digits) as keys")
        if token >= vocab_size:
            raise invalid_field("logit_bias", value, f"an object whose keys are token ids below {vocab_size}",
                           f"The key {show_value(key)} is outside the model's vocabulary (0..{vocab_size - 1}); "
                           f"send token ids below {vocab_size}")
        clean[token] = _real("logit_bias", weight, -100.0, 100.0,
                             "an object mapping token ids (as strings) to numbers in -100..100")
    return clean


def sampling_fields(fields: Mapping[str, Any], vocab_size: int) -> dict[str, Any]:
    """SamplingParams kwargs from the fields both endpoints share (logprobs is endpoint-specific)."""
    out: dict[str, Any] = {}
    if "temperature" in fields:
        out["temperature"] = _real("temperature", fields["temperature"], 0.0, 2.0, "a number between 0 and 2")
    if "top_p" in fields:
        out["top_p"] = _real("top_p", fields["top_p"], 0.0, 1.0, "a number greater than 0 and at most 1",
                             low_open=True)
    if "top_k" in fields:
        top_k = whole_number("top_k", fields["top_k"], -1, None, "a whole number: -1 or 0 for off, else k >= 1")
        out["top_k"] = 0 if top_k == -1 else top_k
    if "min_p" in fields:
        out["min_p"] = _real("min_p", fields["min_p"], 0.0, 1.0, "a number between 0 and 1")
    if "seed" in fields:
        out["seed"] = whole_number("seed", fields["seed"], *SEED_RANGE, "a whole number that fits in 64 bits")
    if "stop" in fields:
        out["stop"] = _stop(fields["stop"])
    if "stop_token_ids" in fields:
        ids = fields["stop_token_ids"]
        if not is_list(ids):
            raise invalid_field("stop_token_ids", ids, "an array of token ids")
        out["stop_token_ids"] = tuple(whole_number("stop_token_ids", i, 0, vocab_size - 1, "an array of token ids "
                                                   f"(whole numbers from 0 to {vocab_size - 1})") for i in ids)
    if "ignore_eos" in fields:
        out["ignore_eos"] = _boolean("ignore_eos", fields["ignore_eos"])
    for name in ("frequency_penalty", "presence_penalty"):
        if name in fields:
            out[name] = _real(name, fields[name], -2.0, 2.0, "a number between -2 and 2")
    if "repetition_penalty" in fields:
        out["repetition_penalty"] = _real("repetition_penalty", fields["repetition_penalty"], 0.0, None,
                                          "a number greater than 0 (1 is off)", low_open=True)
    if "logit_bias" in fields:
        out["logit_bias"] = _logit_bias(fields["logit_bias"], vocab_size)
    return out


def _common(fields: Mapping[str, Any], endpoint: str, caps: Any
            ) -> tuple[dict[str, Any], int, bool, bool, str | None]:
    """Sampling kwargs, n, stream, include_usage and request_id; checks the simple refused and inert rows."""
    check_refused_rows(fields, endpoint)
    stream = _boolean("stream", fields["stream"]) if "stream" in fields else False
    include_usage = False
    if "stream_options" in fields:
        include_usage = _stream_options(fields["stream_options"], stream)
    sampling = sampling_fields(fields, vocab_size_of(caps))
    budget = "max_completion_tokens" if "max_completion_tokens" in fields else "max_tokens"
    if budget in fields:
        sampling["max_tokens"] = whole_number(budget, fields[budget], 1, None, "a whole number of tokens, at least 1")
    if budget == "max_completion_tokens" and "max_tokens" in fields:  # still type-checked when overridden
        whole_number("max_tokens", fields["max_tokens"], 1, None, "a whole number of tokens, at least 1")
    n = whole_number("n", fields["n"], 1, MAX_N, f"a whole number from 1 to {MAX_N}") if "n" in fields else 1
    request_id = None
    if "request_id" in fields:
        request_id = _string("request_id", fields["request_id"])
        if (not request_id or len(request_id) > _MAX_REQUEST_ID or "/" in request_id
                or any(c.isspace() or not c.isprintable() for c in request_id)):
            raise invalid_field("request_id", request_id,
                           f"a non-empty string of at most {_MAX_REQUEST_ID} printable characters without "
                           "spaces or '/'")
    return sampling, n, stream, include_usage, request_id


# ----------------------------------------------------------------------------------------------------
# Endpoints
# ----------------------------------------------------------------------------------------------------


def _check_values(field: str, value: Any) -> None:
    """Nesting within ``MAX_JSON_DEPTH`` and every string (keys too) valid UTF-8 (no lone surrogates)."""
    pending: list[tuple[Any, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequestError(f'"{field}" is nested more than {MAX_JSON_DEPTH} levels deep', param=field)
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidRequestError(
                    f'"{field}" holds a string that is not valid Unicode (a lone surrogate such as \\ud800); '
                    "send well-formed UTF-16 surrogate pairs or plain characters", param=field) from None
        elif isinstance(item, Mapping):
            pending.extend((k, depth) for k in item)
            pending.extend((v, depth + 1) for v in item.values())
        elif is_list(item):
            pending.extend((v, depth + 1) for v in item)


def body_mapping(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise InvalidRequestError(f"the request body must be a JSON object, got {show_value(body)}", param=None)
    for key, value in body.items():
        _check_values(str(key), key)
        _check_values(str(key), value)
    return body


def _messages(value: Any) -> list:
    if not is_list(value) or not value:
        raise invalid_field("messages", value, "a non-empty array of message objects")
    for message in value:
        if not isinstance(message, Mapping):
            raise invalid_field("messages", value, "a non-empty array of message objects",
                           f"The entry {show_value(message)} is not an object; send each message as an object")
        role = message.get("role")
        if role not in _ROLES:
            raise invalid_field("messages", value, "a non-empty array of message objects",
                           f"A message has the role {show_value(role)}; send each message with a role among "
                           f"{', '.join(_ROLES)}")
    return list(value)


def _tools(value: Any) -> list:
    if not is_list(value):
        raise invalid_field("tools", value, "an array of tool objects")
    for tool in value:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if (not isinstance(tool, Mapping) or tool.get("type", "function") != "function"
                or not isinstance(function, Mapping) or not isinstance(function.get("name"), str)
                or not function["name"]):
            raise unsupported_field("tools", value,
                               f"the tool {show_value(tool)} is not a function tool; only "
                               '{"type": "function", "function": {"name": ...}} definitions reach the template',
                               "Send function tools only")
    return list(value)


def _response_format(value: Any, caps: Any) -> Mapping[str, Any]:
    fmt = object_field("response_format", value)
    kind = fmt.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid_field("response_format", value,
                            'an object whose "type" is "text", "json_object" or "json_schema"')
    if kind == "json_schema" and not isinstance(fmt.get("json_schema"), Mapping):
        raise invalid_field("response_format", value,
                            'an object with a "json_schema" object when its type is json_schema')
    if kind != "text" and not _cap(caps, "structured_outputs"):
        raise unsupported_field("response_format", value,
                           "this engine declares no structured outputs, so the answer could not be constrained "
                           "to the format", 'Send {"type": "text"} or omit "response_format"'
                           + _torch_backend_advice(caps))
    return fmt


def chat_options_of(fields: Mapping[str, Any], caps: Any, *, tool_choice_as_sent: Any = None) -> dict[str, Any]:
    """The chat options of ``fields``, checked against ``caps``.

    ``tool_choice_as_sent``: the client's own spelling of ``tool_choice`` where ``fields`` carry a translation
    of it (``/v1/responses``); its refusals quote that.
    """
    options: dict[str, Any] = {}
    if "tools" in fields:
        tools = _tools(fields["tools"])
        if tools:
            options["tools"] = tools
    check_tool_choice(fields.get("tool_choice"), options.get("tools"), fields.get("parallel_tool_calls"),
                      structured_outputs=bool(_cap(caps, "structured_outputs")), as_sent=tool_choice_as_sent)
    if "tool_choice" in fields:
        options["tool_choice"] = fields["tool_choice"]
    if fields.get("parallel_tool_calls") is False:
        options["parallel_tool_calls"] = False
    if "response_format" in fields:
        options["response_format"] = _response_format(fields["response_format"], caps)
        check_response_format(options["response_format"], structured_outputs=True,
                              tool_choice=fields.get("tool_choice"))
    if "reasoning_effort" in fields:
        effort = fields["reasoning_effort"]
        if effort not in REASONING_EFFORTS:
            raise invalid_field("reasoning_effort", effort, f"one of {', '.join(REASONING_EFFORTS)}")
        options["reasoning_effort"] = effort
    for name in ("thinking_mode", "add_generation_prompt"):
        if name in fields:
            options[name] = _boolean(name, fields[name])
    if "chat_template_kwargs" in fields:
        kwargs = object_field("chat_template_kwargs", fields["chat_template_kwargs"])
        for key in kwargs:
            if not isinstance(key, str) or key in _TEMPLATE_RESERVED:
                raise unsupported_field("chat_template_kwargs", kwargs,
                                   f"{show_value(key)} is set by the server itself when it renders the template",
                                   "Send it as its own request field, or remove it from chat_template_kwargs")
        options["chat_template_kwargs"] = dict(kwargs)
    return options


def parse_chat_request(body: Mapping[str, Any], caps: Any = None) -> ParsedRequest:
    """Validate a ``/v1/chat/completions`` body against the policy table and ``caps``."""
    body = body_mapping(body)
    check_known_fields(body, CHAT)
    fields = present_fields(body)
    if "messages" not in fields:
        raise InvalidRequestError('"messages" is required: send the conversation as an array of message '
                                  "objects.", param="messages")
    messages = _messages(fields["messages"])
    sampling, n, stream, include_usage, request_id = _common(fields, CHAT, caps)

    want = False
    if "logprobs" in fields:
        if not isinstance(fields["logprobs"], bool):
            raise invalid_field("logprobs", fields["logprobs"], "true or false on /v1/chat/completions",
                           'A count is the /v1/completions spelling; here send "logprobs": true and the number of '
                           'alternatives as "top_logprobs"')
        want = fields["logprobs"]
    top = None
    if "top_logprobs" in fields:
        top = whole_number("top_logprobs", fields["top_logprobs"], 0, MAX_LOGPROBS,
                     f"a whole number from 0 to {MAX_LOGPROBS}")
        if top > 0 and not want:
            raise unsupported_field("top_logprobs", fields["top_logprobs"],
                               "there is no ranking to take alternatives from unless the request asks for log "
                               "probabilities", 'Send "logprobs": true with it, or omit "top_logprobs"')
    if want:
        _check_logprobs_caps("top_logprobs", top or 0, caps, True)
        sampling["logprobs"] = top or 0

    options = chat_options_of(fields, caps)
    drop_thinking = _boolean("drop_thinking", fields["drop_thinking"]) if "drop_thinking" in fields else None
    check_caps(body, sampling, n, caps)
    return ParsedRequest(endpoint=CHAT, messages=messages, prompts=None, sampling=sampling, n=n, stream=stream,
                         want_logprobs=want, chat_options=options, request_id=request_id,
                         drop_thinking=drop_thinking, include_usage=include_usage)


def _prompts(value: Any, vocab_size: int) -> list[str | list[int]]:
    expected = "a string, an array of strings, an array of token ids, or an array of token-id arrays"

    def token_ids(ids: Any) -> list[int] | None:
        if not is_list(ids) or not ids:
            return None
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            return None
        outside = next((t for t in ids if t >= vocab_size), None)
        if outside is not None:
            raise invalid_field("prompt", value, f"token ids below {vocab_size}",
                           f"The token id {outside} is outside the model's vocabulary (0..{vocab_size - 1})")
        return list(ids)

    if isinstance(value, str):
        return [value]
    if is_list(value) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        single = token_ids(value)
        if single is not None:
            return [single]
        many = [token_ids(p) for p in value]
        if all(ids is not None for ids in many):
            return many  # type: ignore[return-value]
    raise invalid_field("prompt", value, expected,
                   "Send one of those shapes; a list must hold only strings, only token ids, or only non-empty "
                   "token-id arrays")


def parse_completion_request(body: Mapping[str, Any], caps: Any = None) -> ParsedRequest:
    """Validate a ``/v1/completions`` body against the policy table and ``caps``."""
    body = body_mapping(body)
    check_known_fields(body, COMPLETIONS)
    fields = present_fields(body)
    if "prompt" not in fields:
        raise InvalidRequestError('"prompt" is required: send a string, an array of strings, or token ids.',
                                  param="prompt")
    prompts = _prompts(fields["prompt"], vocab_size_of(caps))
    sampling, n, stream, include_usage, request_id = _common(fields, COMPLETIONS, caps)
    if len(prompts) * n > MAX_CHOICES:
        raise InvalidRequestError(
            f'"prompt" holds {len(prompts)} prompts, which with n={n} make {len(prompts) * n} choices; one request '
            f"may ask for at most {MAX_CHOICES}. Send the prompts in several requests", param="prompt")

    want = "logprobs" in fields
    if want:
        count = whole_number("logprobs", fields["logprobs"], 0, MAX_LOGPROBS,
                       f"a whole number from 0 to {MAX_LOGPROBS}, the number of alternatives per position",
                       'On /v1/completions "logprobs" is a count, not a boolean (that is the chat spelling); '
                       'send 0 for the sampled token alone')
        _check_logprobs_caps("logprobs", count, caps, fields["logprobs"])
        sampling["logprobs"] = count

    check_caps(body, sampling, n, caps)
    return ParsedRequest(endpoint=COMPLETIONS, messages=None, prompts=prompts, sampling=sampling, n=n,
                         stream=stream, want_logprobs=want, chat_options={}, request_id=request_id,
                         drop_thinking=None, include_usage=include_usage)
