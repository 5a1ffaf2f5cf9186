"""Tool calls and reasoning through the server, end to end, on the real engine with a scripted forward pass.

The app runs on a tiny random checkpoint with the qwen3_5 or R1-distill template, its logits scripted
(``scripted_server``). The responses are checked through the ``openai`` and ``langchain-openai`` clients and
as raw JSON.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_server import build_chat_checkpoint, openai_client, scripted_forward, serve_scripted

QWEN35_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3_5.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
THOUGHT_AND_CALL = "The user wants weather.\n</think>\n\n" + CALL


@pytest.fixture(scope="module")
def scripts():
    yield from scripted_forward()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, r1_tokenizer, scripts):
    template = QWEN35_TEMPLATE.read_text(encoding="utf-8")
    checkpoint = build_chat_checkpoint(tmp_path_factory, r1_tokenizer, "qwen3", template, "q35")
    client, script = serve_scripted(checkpoint, scripts)
    yield client, script
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def r1(tmp_path_factory, r1_tokenizer, scripts):
    client, script = serve_scripted(build_chat_checkpoint(tmp_path_factory, r1_tokenizer, "qwen2", None, "r1"),
                                    scripts)
    yield client, script
    client.__exit__(None, None, None)


def _post(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


# ----------------------------------------------------------------------------------------------------
# Non-streaming
# ----------------------------------------------------------------------------------------------------


def test_tool_call_response_shape(qwen):
    from openai.types.chat import ChatCompletion

    client, backend = qwen
    backend.script = THOUGHT_AND_CALL
    body = _post(client, messages=ASK, tools=[WEATHER], thinking_mode=True)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["reasoning_content"] == "The user wants weather."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    parsed = ChatCompletion.model_validate(body)
    assert parsed.choices[0].message.tool_calls[0].function.name == "get_weather"
    # The prompt was rendered by the checkpoint's template: tools listed, thinking opened.
    assert '"name": "get_weather"' in backend.prompts[-1]
    assert backend.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")


def test_prose_before_the_call_stays_content(qwen):
    client, backend = qwen
    backend.script = "I'll check the forecast.\n\n" + CALL
    message = _post(client, messages=ASK, tools=[WEATHER])["choices"][0]["message"]
    assert message["content"] == "I'll check the forecast." and len(message["tool_calls"]) == 1
    assert "reasoning_content" not in message  # thinking off: the template closed the block


@pytest.mark.parametrize("script", [
    CALL + "\nAnd then some prose.\n" + CALL,  # prose between calls
    CALL.replace("</parameter>\n<parameter=days>", "\n<parameter=days>"),  # malformed
    CALL.replace("<parameter=days>", "<parameter=city>"),  # duplicate parameter
])
def test_unparseable_calls_stay_in_content(qwen, script):
    client, backend = qwen
    backend.script = script
    choice = _post(client, messages=ASK, tools=[WEATHER])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == script
    assert "tool_calls" not in choice["message"]


def test_call_cut_by_the_budget_stays_in_content(qwen):
    client, backend = qwen
    backend.script = CALL
    budget = len(backend.tokenizer.encode(CALL, add_special_tokens=False)) - 2
    choice = _post(client, messages=ASK, tools=[WEATHER], max_tokens=budget)["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert CALL.startswith(choice["message"]["content"]) and choice["message"]["content"].startswith("<tool_call>")


def test_every_choice_gets_its_calls(qwen):
    client, backend = qwen
    backend.script = CALL + "\n" + CALL.replace("Paris", "Rome").replace("\n3\n", "\n1\n")
    body = _post(client, messages=ASK, tools=[WEATHER], n=2)
    for choice in body["choices"]:
        calls = choice["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "days": 3},
                                                                          {"city": "Rome", "days": 1}]
        assert len({c["id"] for c in calls}) == 2


def test_stop_applies_to_the_answer_not_the_reasoning(qwen):
    client, backend = qwen
    backend.script = "Paris in spring; STOP thinking.\n</think>\n\nMild, about 18 C. STOP here."
    choice = _post(client, messages=ASK, thinking_mode=True, stop=["STOP"])["choices"][0]
    assert choice["message"]["reasoning_content"] == "Paris in spring; STOP thinking."
    assert choice["message"]["content"] == "Mild, about 18 C. " and choice["finish_reason"] == "stop"


# ----------------------------------------------------------------------------------------------------
# The round trip with the openai client: the call replayed verbatim, the tool's result, an answer
# ----------------------------------------------------------------------------------------------------


def test_round_trip_withopenai_client(qwen):
    client, backend = qwen
    api = openai_client(client)
    backend.script = CALL
    first = api.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls"
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    backend.script = "It will be sunny in Paris for the next 3 days."
    replay = [*ASK, assistant.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = api.chat.completions.create(model="tiny", messages=replay, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It will be sunny in Paris for the next 3 days."
    assert not second.choices[0].message.tool_calls
    # The template rendered the replayed call in its own syntax and the tool's result after it.
    prompt = backend.prompts[-1]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>") in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt


def test_round_trip_raw_json_replayed_verbatim(qwen):
    client, backend = qwen
    backend.script = THOUGHT_AND_CALL
    first = _post(client, messages=ASK, tools=[WEATHER], thinking_mode=True)
    assistant = first["choices"][0]["message"]
    backend.script = "Sunny.\n</think>\n\nSunny all week."
    replay = [*ASK, assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                                "content": "sunny"}]
    second = _post(client, messages=replay, tools=[WEATHER], thinking_mode=True)
    assert second["choices"][0]["message"]["content"] == "Sunny all week."
    assert second["choices"][0]["finish_reason"] == "stop"
    assert "<think>\nThe user wants weather.\n</think>" in backend.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------------


def test_streamed_reasoning_and_tool_call_deltas(qwen):
    client, backend = qwen
    backend.script = THOUGHT_AND_CALL
    stream = openai_client(client).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True,
                                                     extra_body={"thinking_mode": True})
    reasoning, content, calls, reasons = [], [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            reasoning.append((delta.model_extra or {}).get("reasoning_content") or "")
            content.append(delta.content or "")
            calls.extend(delta.tool_calls or [])
            reasons.append(choice.finish_reason)
    assert "".join(reasoning) == "The user wants weather." and "".join(content) == ""
    assert sum(1 for r in reasoning if r) > 1, "reasoning is streamed as it is generated"
    header, *fragments = calls  # OpenAI's streamed form: id, type and name first, then argument pieces
    assert header.index == 0 and header.id.startswith("call_") and header.type == "function"
    assert header.function.name == "get_weather" and header.function.arguments == ""
    assert len(fragments) == 2 and all(f.index == 0 and f.id is None and f.function.name is None for f in fragments)
    assert json.loads("".join(f.function.arguments for f in fragments)) == {"city": "Paris", "days": 3}
    assert reasons[-1] == "tool_calls"


def test_stream_equals_non_stream_when_the_call_does_not_parse(qwen):
    client, backend = qwen
    backend.script = "Looking.\n\n" + CALL + "\nextra words"
    whole = _post(client, messages=ASK, tools=[WEATHER])["choices"][0]
    stream = openai_client(client).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole["message"]["content"] == backend.script


# ----------------------------------------------------------------------------------------------------
# langchain-openai
# ----------------------------------------------------------------------------------------------------


def test_langchain_tool_call_round_trip(qwen):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    client, backend = qwen
    chat = ChatOpenAI(model="tiny", base_url="http://testserver/v1", api_key="unused", http_client=client,
                      max_retries=0)
    backend.script = CALL
    question = HumanMessage(ASK[0]["content"])
    reply = chat.bind_tools([WEATHER]).invoke([question])
    assert reply.tool_calls == [{"name": "get_weather", "args": {"city": "Paris", "days": 3},
                                 "id": reply.tool_calls[0]["id"], "type": "tool_call"}]
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    backend.script = "Sunny."
    answer = chat.bind_tools([WEATHER]).invoke(
        [question, reply, ToolMessage("Sunny, 21 C", tool_call_id=reply.tool_calls[0]["id"])])
    assert answer.content == "Sunny." and answer.response_metadata["finish_reason"] == "stop"
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in backend.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# R1 distill: <think> reasoning, and a template that renders no tools
# ----------------------------------------------------------------------------------------------------


def test_r1_reasoning_split(r1):
    client, backend = r1
    backend.script = "<think>\nTwo and two.\n</think>\n\nFour."
    message = _post(client, messages=[{"role": "user", "content": "2+2?"}])["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four.", "reasoning_content": "Two and two."}


def test_r1_template_has_no_tool_support(r1):
    client, _ = r1
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, "tools": [WEATHER]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tools" and "template has no tool support" in error["message"]


def test_r1_call_syntax_is_not_parsed(r1):
    client, backend = r1
    backend.script = CALL  # a syntax this checkpoint's template does not write: left in content
    choice = _post(client, messages=ASK)["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
