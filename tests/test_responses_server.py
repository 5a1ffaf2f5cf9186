"""``POST /v1/responses`` end to end: the ``openai`` SDK (``responses.create`` / ``responses.stream``) and
LangChain's Responses support against the real app and engine.

A tool-capable tiny checkpoint (the qwen3_5 template, Qwen XML calls) and an R1-style one (reasoning) serve
scripted answers (``scripted_server``); a forced tool_choice makes the engine write the JSON form under its
grammar. The default model answers a real question through the Responses API and the chat API alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from scripted_server import build_chat_checkpoint, openai_client, scripted_forward, serve_scripted

QWEN35_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3_5.jinja"

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather forecast for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}, "strict": True}
QUESTION = "What is the weather in Paris for 3 days?"
FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
ANSWER = "It will be sunny in Paris for the next 3 days."


@pytest.fixture(scope="module")
def scripts():
    yield from scripted_forward()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, r1_tokenizer, scripts):
    template = QWEN35_TEMPLATE.read_text(encoding="utf-8")
    client, script = serve_scripted(build_chat_checkpoint(tmp_path_factory, r1_tokenizer, "qwen3", template,
                                                          "resp-q35"), scripts)
    yield client, script
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def r1(tmp_path_factory, r1_tokenizer, scripts):
    client, script = serve_scripted(build_chat_checkpoint(tmp_path_factory, r1_tokenizer, "qwen2", None, "resp-r1"),
                                    scripts)
    yield client, script
    client.__exit__(None, None, None)


def _post(client, **body) -> dict:
    response = client.post("/v1/responses", json={"model": "tiny", **body})
    assert response.status_code == 200, response.text
    return response.json()


def _events(client, **body) -> list[dict]:
    """The raw events of a streamed response, checked to be named by their type."""
    with client.stream("POST", "/v1/responses", json={"model": "tiny", "stream": True, **body}) as response:
        assert response.status_code == 200
        text = "".join(response.iter_text())
    events = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data[len("data: "):])
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


# ----------------------------------------------------------------------------------------------------
# Text
# ----------------------------------------------------------------------------------------------------


def test_text_response_validates_against_the_sdk_types(qwen):
    from openai.types.responses import Response

    client, backend = qwen
    backend.script = ANSWER
    body = _post(client, input=QUESTION, instructions="Answer briefly.", max_output_tokens=64, temperature=0,
                 metadata={"run": "a"}, store=False)
    response = Response.model_validate(body)
    assert response.status == "completed" and response.output_text == ANSWER
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    tokens = len(backend.tokenizer.encode(ANSWER, add_special_tokens=False)) + 1   # the EOS step counts
    assert response.usage.output_tokens == tokens
    assert response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert body["instructions"] == "Answer briefly." and body["metadata"] == {"run": "a"}
    assert backend.prompts[-1].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\n"
                                          + QUESTION)


def test_input_items_become_the_conversation(qwen):
    client, backend = qwen
    backend.script = "Yes."
    _post(client, input=[
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                                          {"type": "input_text", "text": "there."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
        {"role": "user", "content": "Is it sunny?"}])
    prompt = backend.prompts[-1]
    for turn in ("<|im_start|>system\nBe terse.", "<|im_start|>user\nHello there.", "<|im_start|>assistant\nHi.",
                 "<|im_start|>user\nIs it sunny?"):
        assert turn in prompt
    assert prompt.index("Hello there.") < prompt.index("Hi.") < prompt.index("Is it sunny?")


def test_budget_cut_is_incomplete(qwen):
    client, backend = qwen
    backend.script = ANSWER
    body = _post(client, input=QUESTION, max_output_tokens=3)
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 3 and ANSWER.startswith(body["output"][0]["content"][0]["text"])


def test_json_schema_format_takes_the_structured_path(qwen):
    client, backend = qwen
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    backend.script = '{"city": "Paris"}'
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    body = _post(client, input="Which city?", text=fmt)
    assert json.loads(body["output"][0]["content"][0]["text"]) == {"city": "Paris"}
    assert body["text"]["format"]["type"] == "json_schema"
    # The grammar holds the answer to the schema: a script that breaks it cannot be written.
    backend.script = '{"town": "Paris"}'
    text = _post(client, input="Which city?", text=fmt, max_output_tokens=8)["output"][0]["content"][0]["text"]
    assert not text.startswith('{"town"')
    bad = client.post("/v1/responses", json={"input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "objectx"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"


# ----------------------------------------------------------------------------------------------------
# Function tools: the round trip through the SDK, whole and streamed
# ----------------------------------------------------------------------------------------------------


def _round_trip(api, backend, first, follow_up) -> None:
    """A forced call, its output sent back with the call replayed, and an answer."""
    backend.script = FORCED
    response = first(input=QUESTION, tools=[WEATHER], tool_choice="required")
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert call.call_id.startswith("call_") and call.status == "completed"
    backend.script = ANSWER
    history = [{"role": "user", "content": QUESTION}, *[item.model_dump(exclude_none=True) for item in response.output],
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = follow_up(input=history, tools=[WEATHER])
    assert answer.output_text == ANSWER and [item.type for item in answer.output] == ["message"]
    prompt = backend.prompts[-1]
    assert XML_CALL in prompt, "the replayed call is rendered in the template's own syntax"
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt


def test_function_tool_round_trip(qwen):
    client, backend = qwen
    api = openai_client(client)

    def create(**body):
        return api.responses.create(model="tiny", **body)

    _round_trip(api, backend, create, create)


def test_function_tool_round_trip_streamed(qwen):
    client, backend = qwen
    api = openai_client(client)
    seen: list[list[str]] = []

    def stream(**body):
        with api.responses.stream(model="tiny", **body) as events:
            seen.append([event.type for event in events])
            return events.get_final_response()

    _round_trip(api, backend, stream, stream)
    call_events, answer_events = seen
    assert call_events[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert call_events[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    assert call_events.count("response.function_call_arguments.delta") == 2
    assert "response.output_text.delta" not in call_events
    assert answer_events[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert answer_events[-4:] == ["response.output_text.done", "response.content_part.done",
                                  "response.output_item.done", "response.completed"]


def test_named_and_auto_tool_choice(qwen):
    client, backend = qwen
    backend.script = FORCED
    named = _post(client, input=QUESTION, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"})
    backend.script = "Checking.\n\n" + XML_CALL
    auto = _post(client, input=QUESTION, tools=[WEATHER])
    assert [i["type"] for i in named["output"]] == ["function_call"]
    assert [i["type"] for i in auto["output"]] == ["message", "function_call"]
    assert auto["output"][0]["content"][0]["text"] == "Checking."
    for body in (named, auto):
        call = body["output"][-1]
        assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris", "days": 3})
    assert named["tool_choice"] == {"type": "function", "name": "get_weather"} and named["tools"] == [WEATHER]


def test_stream_events_match_the_whole_response(qwen):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    client, backend = qwen
    backend.script = "Checking.\n\n" + XML_CALL
    whole = _post(client, input=QUESTION, tools=[WEATHER])
    events = _events(client, input=QUESTION, tools=[WEATHER])
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in events:   # every event is one of the SDK's types, with no field the type does not define
        parsed = adapter.validate_python(event)
        assert not parsed.model_extra, (event["type"], parsed.model_extra)
        for name in ("item", "part", "response"):
            if name in event:
                assert not getattr(parsed, name).model_extra, (event["type"], name)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created = [e["response"]["created_at"] for e in events if "response" in e] + [whole["created_at"]]
    assert all(type(seconds) is int for seconds in created), created   # whole seconds, as OpenAI's
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["id"] == events[0]["response"]["id"]
    strip = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in final["output"]]
    assert strip == [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in whole["output"]]
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert text == "Checking." and json.loads(arguments) == {"city": "Paris", "days": 3}
    added = [e["item"]["id"] for e in events if e["type"] == "response.output_item.added"]
    assert added == [item["id"] for item in final["output"]]


# ----------------------------------------------------------------------------------------------------
# Reasoning
# ----------------------------------------------------------------------------------------------------


def test_reasoning_becomes_a_reasoning_item(r1):
    client, backend = r1
    backend.script = "<think>\nTwo and two.\n</think>\n\nFour."
    body = _post(client, input="2+2?")
    assert [i["type"] for i in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"] == [{"type": "reasoning_text", "text": "Two and two."}]
    events = _events(client, input="2+2?")
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert reasoning == "Two and two."
    assert events[-1]["response"]["output"][1]["content"][0]["text"] == "Four."
    # The reasoning item replayed before the answer it led to reaches the template as that turn's reasoning.
    backend.script = "<think>\nOk.\n</think>\n\nEight."
    _post(client, input=[{"role": "user", "content": "2+2?"}, *body["output"], {"role": "user", "content": "4+4?"}])
    assert "Four." in backend.prompts[-1] and "4+4?" in backend.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# Field discipline
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields,param", [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"seed": 1}, "seed"),
    ({"messages": []}, "messages"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"reasoning": {"summary": "auto"}}, "reasoning"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),   # this checkpoint's template takes no effort
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 3}, "temperature"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": []}, "input"),
])
def test_refused_fields_name_themselves(qwen, fields, param):
    from openai import BadRequestError

    client, _ = qwen
    with pytest.raises(BadRequestError) as info:
        openai_client(client).responses.create(model="tiny", input="hi", extra_body=fields)
    error = info.value.body   # the OpenAI error shape
    assert set(error) == {"message", "type", "param", "code"}
    assert info.value.status_code == 400 and error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or param == "input"


def test_tool_choice_refusal_quotes_what_the_client_sent(qwen):
    client, _ = qwen
    choice = {"type": "function", "name": "get_time"}
    response = client.post("/v1/responses", json={"model": "tiny", "input": QUESTION, "tools": [WEATHER],
                                                   "tool_choice": choice})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "tool_choice"
    assert error["message"].startswith(f'"tool_choice" = {json.dumps(choice)} ') and "get_weather" in error["message"]


def test_store_refusal_says_so(qwen):
    client, _ = qwen
    response = client.post("/v1/responses", json={"input": "hi", "store": True})
    assert response.status_code == 400 and "stores no responses" not in response.json()["error"]["message"]
    assert "keeps no responses" in response.json()["error"]["message"]
    response = client.post("/v1/responses", json={"input": "hi", "previous_response_id": "resp_1"})
    assert "stores no responses" in response.json()["error"]["message"]


# ----------------------------------------------------------------------------------------------------
# LangChain's Responses support
# ----------------------------------------------------------------------------------------------------


def test_langchain_responses_api(qwen):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    client, backend = qwen
    chat = ChatOpenAI(model="tiny", base_url="http://testserver/v1", api_key="unused", http_client=client,
                      max_retries=0, use_responses_api=True, store=False)
    backend.script = FORCED
    question = HumanMessage(QUESTION)
    reply = chat.bind_tools([WEATHER], tool_choice="any").invoke([question])
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    merged = None
    for chunk in chat.bind_tools([WEATHER], tool_choice="any").stream([question]):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in reply.tool_calls]
    backend.script = ANSWER
    answer = chat.bind_tools([WEATHER]).invoke(
        [question, reply, ToolMessage("Sunny, 21 C", tool_call_id=reply.tool_calls[0]["id"])])
    assert answer.text == ANSWER
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in backend.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# The default model
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_server(smollm2_gguf):
    from server_utils import ServerProcess

    proc = ServerProcess("--served-model-name", "smollm2")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


def test_default_model_answers_through_responses(default_server):
    from openai import OpenAI

    api = OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)
    response = api.responses.create(model="smollm2", input="What is the capital of France?", temperature=0,
                                    max_output_tokens=32)
    chat = api.chat.completions.create(model="smollm2", temperature=0, max_tokens=32,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert response.output_text == chat.choices[0].message.content and "Paris" in response.output_text
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    with api.responses.stream(model="smollm2", input="What is the capital of France?", temperature=0,
                              max_output_tokens=32) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text
    assert httpx.post(default_server.url + "/v1/responses", json={"input": "hi", "bogus": 1}).json()["error"][
        "param"] == "bogus"


def test_a_forced_call_cut_by_the_budget_streams_as_text_at_the_end(qwen):
    client, backend = qwen
    backend.script = FORCED
    budget = len(backend.tokenizer.encode(FORCED, add_special_tokens=False)) - 2
    body = {"input": QUESTION, "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": budget}
    whole = _post(client, **body)
    events = _events(client, **body)
    assert not any(e["type"].startswith("response.function_call") for e in events)
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert len(deltas) == 1 and FORCED.startswith(deltas[0]), "held back, then sent whole"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == whole["incomplete_details"] == {
        "reason": "max_output_tokens"}
    assert [i["type"] for i in whole["output"]] == ["message"] and whole["output"][0]["status"] == "incomplete"
    assert whole["output"][0]["content"][0]["text"] == deltas[0]


def test_a_stream_closed_early_ends_its_request(qwen):
    client, backend = qwen
    backend.script = "word " * 800   # longer than the context: runs until the budget unless cancelled
    serving = client.app.state.pocketllm.serving
    before = _disconnects(client)
    with client.stream("POST", "/v1/responses", json={"input": QUESTION, "stream": True}) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["type"] == "response.created"
        request_id = response.headers["X-Request-Id"]
        assert request_id in serving.jobs
    deadline = time.monotonic() + 30
    while request_id in serving.jobs:   # the job ends once the app sees the stream closed
        assert time.monotonic() < deadline, "the closed stream's request is still registered"
        time.sleep(0.01)
    assert client.delete(f"/v1/requests/{request_id}").status_code == 404
    assert _disconnects(client) == before + 1, "the request was cancelled, not run to its end"


def _disconnects(client) -> float:
    """``pocketllm:request_aborted_total{reason="client_disconnect"}``."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("pocketllm:request_aborted_total") and 'reason="client_disconnect"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0
