"""Input limits at the edge: nesting, strict UTF-8, token ids and logit_bias keys within the vocabulary, stop caps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.openai_fields import (
    MAX_JSON_DEPTH,
    MAX_STOP,
    MAX_STOP_CHARS,
    parse_chat_request,
    parse_completion_request,
)

CAPS = SimpleNamespace(details={"vocab_size": 1000})
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def _refused(parse, body: dict, param: str) -> str:
    with pytest.raises(InvalidRequestError) as info:
        parse(body, CAPS)
    assert info.value.param == param
    return str(info.value)


def test_lone_surrogate_is_a_400_naming_the_field() -> None:
    body = json.loads('{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert "not valid Unicode" in _refused(parse_chat_request, body, "messages")
    assert "not valid Unicode" in _refused(parse_completion_request, json.loads('{"prompt": "a\\udfff"}'), "prompt")
    # A well-formed pair is one character and is accepted.
    ok = parse_completion_request(json.loads('{"prompt": "\\ud83d\\ude00"}'), CAPS)
    assert ok.prompts == ["\U0001F600"]


def test_nesting_beyond_the_limit_is_refused() -> None:
    deep: object = "x"
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    assert "nested more than" in _refused(parse_chat_request, {**CHAT, "prompt_cache_options": {"k": deep}},
                                              "prompt_cache_options")
    shallow: object = "x"
    for _ in range(MAX_JSON_DEPTH - 2):
        shallow = [shallow]
    parse_chat_request({**CHAT, "prompt_cache_options": {"k": shallow}}, CAPS)   # within the limit: accepted


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    assert "outside the model's vocabulary" in _refused(parse_completion_request, {"prompt": [1, 1000]}, "prompt")
    _refused(parse_completion_request, {"prompt": [9223372036854775808]}, "prompt")
    assert parse_completion_request({"prompt": [0, 999]}, CAPS).prompts == [[0, 999]]


@pytest.mark.parametrize("key", ["١", " 5", "05", "+5", "5.0", "1000", "-1", "٥"])
def test_logit_bias_keys_are_canonical_ids_in_the_vocabulary(key: str) -> None:
    _refused(parse_completion_request, {"prompt": "a", "logit_bias": {key: 1}}, "logit_bias")


def test_logit_bias_accepts_canonical_keys() -> None:
    parsed = parse_completion_request({"prompt": "a", "logit_bias": {"0": 1, "999": -2.5}}, CAPS)
    assert parsed.sampling["logit_bias"] == {0: 1.0, 999: -2.5}


def test_stop_strings_are_capped() -> None:
    _refused(parse_completion_request, {"prompt": "a", "stop": ["x"] * (MAX_STOP + 1)}, "stop")
    _refused(parse_completion_request, {"prompt": "a", "stop": "x" * (MAX_STOP_CHARS + 1)}, "stop")
    parsed = parse_completion_request({"prompt": "a", "stop": ["x"] * MAX_STOP}, CAPS)
    assert len(parsed.sampling["stop"]) == MAX_STOP


@pytest.mark.parametrize("schema", [
    {"not": {}}, {"anyOf": []}, {"oneOf": [{"not": {}}, False]}, {"enum": []}, {"type": []},
    {"allOf": [{"type": "object"}, {"not": {}}]},
    {"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
])
def test_unsatisfiable_schema_is_refused(schema: dict) -> None:
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request(body, SimpleNamespace(structured_outputs=True, details={"vocab_size": 1000}))
    assert info.value.param == "response_format" and "admits no value" in str(info.value)


def test_satisfiable_schema_with_an_optional_impossible_property_is_accepted() -> None:
    schema = {"type": "object", "properties": {"a": {"not": {}}}}   # "a" may be left out
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    parse_chat_request(body, SimpleNamespace(structured_outputs=True, details={"vocab_size": 1000}))


def test_harness_lines_are_always_utf8() -> None:
    from pocketllm.harness.protocol import encode, valid_session_id

    line = encode({"id": json.loads('"\\ud800"'), "error": "x", "text": "é"})
    line.encode("utf-8")
    assert json.loads(line)["id"] == json.loads('"\\ud800"')
    assert encode({"id": 1, "text": "é"}) == '{"id":1,"text":"é"}'   # plain lines keep their characters
    assert valid_session_id("abc") and not valid_session_id("abc\n") and not valid_session_id("a/b")


@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty", "min_p",
                                   "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_refused(field: str) -> None:
    _refused(parse_completion_request, {"prompt": "a", field: 10**400}, field)
    _refused(parse_completion_request, {"prompt": "a", "logit_bias": {"1": -(10**400)}}, "logit_bias")
