"""Our DeepSeek-V4 prompt encoder against the format notes (spec/deepseek-v4-encoding.md), and the way its
answers are read back (reasoning, DSML calls). The model itself is tested in test_deepseek_v4_model.py."""

from __future__ import annotations

import copy
import json

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_output import chat_output_spec, detect_chat_syntax
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.protocol.deepseek_v4 import (
    MAX_EFFORT_PARAGRAPH,
    RESPONSE_FORMAT_SECTION,
    encode_messages,
)
from pocketllm.protocol.reasoning import INSIDE, ReasoningSplitter
from pocketllm.protocol.tool_parsers import DsmlToolParser, ToolCallStream

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
D = "｜DSML｜"
ARCH = "DeepseekV4ForCausalLM"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_chat_and_thinking_openers():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == f"{BOS}Be brief.{U}Hi{A}</think>"
    assert encode_messages(messages, thinking_mode="thinking") == f"{BOS}Be brief.{U}Hi{A}<think>"
    assert encode_messages(messages, add_generation_prompt=False) == f"{BOS}Be brief.{U}Hi"
    assert encode_messages(messages, add_bos=False).startswith("Be brief.")


def test_history_and_drop_thinking():
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "add"},
                {"role": "user", "content": "3+3?"}]
    dropped = encode_messages(messages, thinking_mode="thinking")
    assert dropped == f"{BOS}{U}2+2?{A}</think>4{EOS}{U}3+3?{A}<think>"
    kept = encode_messages(messages, thinking_mode="thinking", drop_thinking=False)
    assert kept == f"{BOS}{U}2+2?{A}<think>add</think>4{EOS}{U}3+3?{A}<think>"
    assert encode_messages(messages) == f"{BOS}{U}2+2?{A}</think>4{EOS}{U}3+3?{A}</think>"


def test_tools_section_calls_and_merged_tool_results():
    calls = [{"id": "a", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris", "days": 3})}},
             {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]
    messages = [{"role": "system", "content": "Sys."},
                {"role": "user", "content": "Weather and time?"},
                {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls", "tool_calls": calls},
                {"role": "tool", "tool_call_id": "b", "content": "12:00"},
                {"role": "tool", "tool_call_id": "a", "content": "Sunny"}]
    original = copy.deepcopy(messages)
    prompt = encode_messages(messages, thinking_mode="thinking", tools=[WEATHER, TIME])
    assert messages == original
    system, rest = prompt.split(U, 1)
    assert system.startswith(f"{BOS}Sys.\n\n## Tools\n\n")
    schemas = system.split("### Available Tool Schemas\n\n", 1)[1].split("\n")
    assert [json.loads(line) for line in schemas] == [WEATHER["function"], TIME["function"]]
    assert 'string="true"' in system and 'string="false"' in system and "<think>" in system
    block = (f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
             f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
             f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n</{D}invoke>\n"
             f"<{D}invoke name=\"get_time\">\n</{D}invoke>\n</{D}tool_calls>")
    # Tools on a message force drop_thinking off, so this turn's reasoning is kept; the tool results join
    # one user turn in the order of the calls they answer.
    assert rest == (f"Weather and time?{A}<think>two calls</think>Checking.\n\n{block}{EOS}"
                    f"{U}<tool_result>Sunny</tool_result>\n\n<tool_result>12:00</tool_result>{A}<think>")


def test_tools_without_a_system_message_and_developer_role():
    prompt = encode_messages([{"role": "user", "content": "Hi"}], tools=[TIME])
    assert prompt.startswith(f"{BOS}\n\n## Tools\n\n") and prompt.endswith(f"{U}Hi{A}</think>")
    dev = encode_messages([{"role": "developer", "content": "Rules.", "tools": [TIME]},
                           {"role": "user", "content": "Hi"}])
    assert dev.startswith(f"{BOS}{U}Rules.\n\n## Tools\n\n") and dev.endswith(f"{U}Hi{A}</think>")


def test_response_format_section():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    prompt = encode_messages([{"role": "user", "content": "Give x"}],
                             response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert prompt == (f"{BOS}\n\n{RESPONSE_FORMAT_SECTION}{json.dumps(schema)}{U}Give x{A}</think>")
    assert RESPONSE_FORMAT_SECTION == ("## Response Format:\n\nYou MUST strictly adhere to the following schema "
                                       "to reply:\n")


def test_reasoning_effort():
    messages = [{"role": "user", "content": "Prove it."}]
    assert encode_messages(messages, thinking_mode="thinking", reasoning_effort="max") == (
        f"{BOS}{U}{MAX_EFFORT_PARAGRAPH}Prove it.{A}<think>")
    assert encode_messages(messages, thinking_mode="thinking", reasoning_effort="high") == (
        encode_messages(messages, thinking_mode="thinking"))
    assert encode_messages(messages, reasoning_effort="max") == encode_messages(messages)  # chat mode: no change
    with pytest.raises(InvalidRequestError) as info:
        encode_messages(messages, reasoning_effort="low")
    assert info.value.param == "reasoning_effort"


def test_the_chat_builder_uses_the_encoder_for_deepseek_v4_without_a_template():
    messages = [{"role": "user", "content": "Hi"}]
    assert build_chat_prompt(None, messages, architecture=ARCH) == f"{BOS}{U}Hi{A}</think>"
    assert build_chat_prompt(None, messages, architecture=ARCH, thinking_mode=True).endswith(f"{A}<think>")
    assert build_chat_prompt(None, messages, architecture=ARCH, thinking_mode=True,
                             reasoning_effort="xhigh").startswith(f"{BOS}{U}{MAX_EFFORT_PARAGRAPH}")
    assert "## Tools" in build_chat_prompt(None, messages, architecture=ARCH, tools=[WEATHER])
    with pytest.raises(InvalidRequestError, match="ships no chat template"):
        build_chat_prompt(None, messages, architecture="Qwen3ForCausalLM")
    with pytest.raises(InvalidRequestError):
        build_chat_prompt(None, messages, architecture=ARCH, chat_template_kwargs={"x": 1})


def test_answers_read_back_reasoning_then_dsml_calls():
    prompt = build_chat_prompt(None, [{"role": "user", "content": "Weather?"}], architecture=ARCH,
                               thinking_mode=True, tools=[WEATHER])
    spec = chat_output_spec(detect_chat_syntax(None, ARCH), prompt, [WEATHER])
    assert spec.reasoning_state == INSIDE and isinstance(spec.tool_parser, DsmlToolParser)
    output = ("Need the forecast.</think>Let me look.\n\n"
              f"<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")
    splitter = ReasoningSplitter(spec.reasoning, spec.reasoning_state)
    calls = ToolCallStream(spec.tool_parser, spec.tools)
    reasoning, shown = "", ""
    for i in range(0, len(output), 5):
        r, a = splitter.push(output[i:i + 5])
        reasoning += r
        shown += calls.push(a)
    r, a = splitter.flush()
    reasoning, shown = reasoning + r, shown + calls.push(a)
    tail, parsed = calls.finish()
    assert reasoning == "Need the forecast." and shown + tail == "Let me look."
    assert parsed.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris",
                                                                                          "days": 3})]
