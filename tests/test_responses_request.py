"""``/v1/responses`` bodies as chat requests (``protocol/responses_request.py``) and streamed tool-call deltas
(``protocol/tool_call_deltas.py``), without a model."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.responses_request import parse_responses_request
from pocketllm.protocol.tool_call_deltas import argument_fragments, tool_call_deltas

CAPS = SimpleNamespace(structured_outputs=True)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def chat(caps=CAPS, **body):
    return parse_responses_request(body, caps).chat


def test_a_string_input_is_one_user_message_after_the_instructions():
    parsed = chat(input="Hi", instructions="Be brief.", max_output_tokens=7, temperature=0.5, top_p=0.9)
    assert parsed.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert parsed.sampling == {"max_tokens": 7, "temperature": 0.5, "top_p": 0.9}
    assert parsed.n == 1 and not parsed.stream and parsed.chat_options == {}


def test_items_become_chat_messages():
    items = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "Rain"}]},
        {"role": "developer", "content": "Answer in French."},
    ]
    messages = chat(input=items).messages
    assert messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Hm.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": "Rain"},
        {"role": "developer", "content": "Answer in French."},
    ]


def test_a_replayed_refusal_is_what_the_assistant_said():
    # A refused response's output message holds a refusal part; a client replays the output as input.
    refused = {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}
    messages = chat(input=[{"role": "user", "content": "a"}, refused, {"role": "user", "content": "b"}]).messages
    assert messages[1] == {"role": "assistant", "content": "I can't."}
    with pytest.raises(InvalidRequestError, match="refusal in an assistant message"):
        chat(input=[{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])


def test_a_call_after_a_tool_result_opens_a_new_assistant_turn():
    items = [{"role": "user", "content": "x"},
             {"type": "function_call", "call_id": "a", "name": "f", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "a", "output": "1"},
             {"type": "function_call", "call_id": "b", "name": "f", "arguments": "{}"}]
    roles = [(m["role"], [c["id"] for c in m.get("tool_calls", [])]) for m in chat(input=items).messages]
    assert roles == [("user", []), ("assistant", ["a"]), ("tool", []), ("assistant", ["b"])]


def test_tools_tool_choice_text_and_reasoning_take_the_chat_spellings():
    fmt = {"type": "json_schema", "name": "city", "schema": {"type": "object"}, "strict": True}
    parsed = parse_responses_request({"input": "x", "tools": [TOOL], "parallel_tool_calls": False,
                                      "tool_choice": {"type": "function", "name": "get_weather"},
                                      "reasoning": {"effort": "high", "summary": None}}, CAPS)
    assert parsed.chat.chat_options == {
        "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                    "parameters": TOOL["parameters"]}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "parallel_tool_calls": False,
        "reasoning_effort": "high"}
    assert parsed.echo["tools"] == [TOOL] and parsed.echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert chat(input="x", text={"format": fmt}).chat_options == {
        "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object"},
                                                                   "strict": True}}}
    assert chat(input="x", text={"format": {"type": "json_object"}}).chat_options == {
        "response_format": {"type": "json_object"}}
    assert chat(input="x", text={"format": {"type": "text"}, "verbosity": None}).chat_options == {}


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [TOOL], "tool_choice": "required"}, "tool_choice"),   # no structured outputs
    ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
    ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [TOOL]}, "tool_choice"),
])
def test_chat_checks_name_the_responses_field(body, param):
    with pytest.raises(InvalidRequestError) as info:
        parse_responses_request(body, SimpleNamespace(structured_outputs=False))
    assert info.value.param == param


@pytest.mark.parametrize("choice,tools,caps", [
    ({"type": "function", "name": "nope"}, [TOOL], CAPS),           # not among the tools
    ({"type": "function", "name": "get_weather"}, None, CAPS),      # no tools to call
    ({"type": "function", "name": "get_weather"}, [TOOL], None),    # no structured outputs
    ({"type": "function", "name": ""}, [TOOL], CAPS),
    ({"type": "function"}, [TOOL], CAPS),
    ({"type": "function", "function": {"name": "get_weather"}}, [TOOL], CAPS),   # the chat spelling
])
def test_tool_choice_refusals_quote_the_responses_spelling(choice, tools, caps):
    body = {"input": "x", "tool_choice": choice, **({"tools": tools} if tools else {})}
    with pytest.raises(InvalidRequestError) as info:
        parse_responses_request(body, caps)
    assert info.value.param == "tool_choice"
    assert info.value.message.startswith(f'"tool_choice" = {json.dumps(choice)} ')
    if "function" not in choice:
        assert '"function": {' not in info.value.message   # the chat spelling is neither quoted nor asked for


@pytest.mark.parametrize("arguments", [
    '{"city": "Paris", "days": 3}', "{}", '{"a": {"b": [1, 2], "c": "x, }"}, "d": "q\\\\"}', '{"only": [1, {"x": 2}]}',
    '{"s": "\\", \\""}',
])
def test_argument_fragments_join_back(arguments):
    pieces = argument_fragments(arguments)
    assert "".join(pieces) == arguments and all(pieces)
    assert len(pieces) == max(1, len(json.loads(arguments)))   # one piece per top-level member


def test_tool_call_deltas_are_openai_streamed_form():
    calls = [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}},
             {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]
    assert tool_call_deltas(calls) == [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"x": 1, '}},
        {"index": 0, "function": {"arguments": '"y": 2}'}},
        {"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}},
    ]
