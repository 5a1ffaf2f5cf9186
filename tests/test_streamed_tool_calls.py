"""Streamed tool calls for every tool_choice and every call syntax, equal to the non-streamed result.

Three checkpoints whose templates write the three call syntaxes the server reads (Qwen's XML, Hermes JSON,
DeepSeek's DSML) serve scripted answers (``scripted_server``); a forced tool_choice (required or a named
function) makes the engine write the JSON form under its grammar. Streams are read through the ``openai`` SDK's
stream helper and LangChain's ``.stream``, and as raw chunks.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scripted_server import build_chat_checkpoint, openai_client, scripted_forward, serve_scripted

QWEN35_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3_5.jinja"

# A ChatML template that writes calls as Hermes JSON (as Qwen2.5's does).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for call in message.tool_calls %}
<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# A template that writes calls in DeepSeek-V4's DSML.
DSML_TEMPLATE = """{%- if tools %}Tools: {{ tools | tojson }}
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<｜Assistant｜>

<｜DSML｜tool_calls>
{%- for call in message.tool_calls %}
<｜DSML｜invoke name="{{ call.function.name }}">
</｜DSML｜invoke>
{%- endfor %}
</｜DSML｜tool_calls>
{% elif message.role == "user" %}<｜User｜>{{ message.content }}
{% else %}{{ message.role }}: {{ message.content }}
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<｜Assistant｜>{% endif %}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
ARGUMENTS = {"city": "Paris", "days": 3}

# The answer each syntax writes for get_weather(city="Paris", days=3).
CALLS = {
    "qwen_xml": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                 "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"),
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>',
    "dsml": ('<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
             '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
             '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n'
             '</｜DSML｜invoke>\n</｜DSML｜tool_calls>'),
}
FORCED = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]'
FORCED_TWO = FORCED[:-1] + ', {"name": "get_time", "arguments": {"zone": "CET"}}]'
FORCED_CHOICES = ["required", {"type": "function", "function": {"name": "get_weather"}}]


@pytest.fixture(scope="module")
def scripts():
    yield from scripted_forward()


@pytest.fixture(scope="module", params=["qwen_xml", "hermes", "dsml"])
def server(request, tmp_path_factory, r1_tokenizer, scripts):
    """(syntax, TestClient, Script) for a checkpoint whose template writes that call syntax."""
    arch, template = {"qwen_xml": ("qwen3", QWEN35_TEMPLATE.read_text(encoding="utf-8")),
                      "hermes": ("qwen2", HERMES_TEMPLATE), "dsml": ("llama", DSML_TEMPLATE)}[request.param]
    client, script = serve_scripted(
        build_chat_checkpoint(tmp_path_factory, r1_tokenizer, arch, template, request.param), scripts)
    yield request.param, client, script
    client.__exit__(None, None, None)


def _whole(client, **body) -> dict:
    response = client.post("/v1/chat/completions", json={"model": "tiny", "messages": ASK, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def _chunks(client, **body) -> list[dict]:
    """The raw chunks of a stream (``[DONE]`` checked and left out)."""
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "tiny", "messages": ASK, "stream": True, **body}) as response:
        assert response.status_code == 200
        lines = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _named_calls(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _check_streamed_form(chunks: list[dict]) -> list[dict]:
    """The calls a stream sent, checked to be in OpenAI's streamed form: per call a first delta with index, id,
    type and name (empty arguments), then argument fragments with the index alone; the last chunk finishes."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for entry in chunk["choices"][0]["delta"].get("tool_calls", []):
            if entry["index"] not in calls:
                assert entry["id"].startswith("call_") and entry["type"] == "function"
                assert entry["function"]["name"] and entry["function"]["arguments"] == ""
                calls[entry["index"]] = {"id": entry["id"], "type": "function",
                                         "function": {"name": entry["function"]["name"], "arguments": ""}}
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "tool_calls"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    return [calls[i] for i in sorted(calls)]


# ----------------------------------------------------------------------------------------------------
# Every syntax, every tool_choice: streamed equal to non-streamed
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", [None, "auto", *FORCED_CHOICES])
def test_streamed_calls_equal_the_whole_response(server, tool_choice):
    syntax, client, backend = server
    backend.script = CALLS[syntax] if tool_choice in (None, "auto") else FORCED
    body = {"tools": TOOLS, **({"tool_choice": tool_choice} if tool_choice else {})}
    whole = _whole(client, **body)
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    assert _named_calls(whole["message"]["tool_calls"]) == [("get_weather", ARGUMENTS)]
    chunks = _chunks(client, **body)
    calls = _check_streamed_form(chunks)
    assert _named_calls(calls) == _named_calls(whole["message"]["tool_calls"])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == ""
    fragments = [e for c in chunks for e in c["choices"][0]["delta"].get("tool_calls", []) if "id" not in e]
    assert len(fragments) == 2, "the arguments arrive in pieces, one per member"


def test_two_forced_calls_stream_with_their_own_indexes(server):
    _, client, backend = server
    backend.script = FORCED_TWO
    whole = _whole(client, tools=TOOLS, tool_choice="required")
    calls = _check_streamed_form(_chunks(client, tools=TOOLS, tool_choice="required"))
    assert _named_calls(calls) == _named_calls(whole["message"]["tool_calls"]) == [
        ("get_weather", ARGUMENTS), ("get_time", {"zone": "CET"})]
    assert len({c["id"] for c in calls}) == 2


def test_openai_stream_helper_yields_the_forced_call(server):
    _, client, backend = server
    backend.script = FORCED
    api = openai_client(client)
    whole = api.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required")
    with api.chat.completions.stream(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required") as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    streamed = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.choices[0].message.tool_calls]
    assert streamed == expected == [("get_weather", ARGUMENTS)]
    assert "tool_calls.function.arguments.delta" in events and "tool_calls.function.arguments.done" in events


def test_langchain_stream_yields_the_forced_call(server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    _, client, backend = server
    backend.script = FORCED
    chat = ChatOpenAI(model="tiny", base_url="http://testserver/v1", api_key="unused", http_client=client,
                      max_retries=0).bind_tools(TOOLS, tool_choice="any")
    question = [HumanMessage(ASK[0]["content"])]
    whole = chat.invoke(question)
    merged = None
    for chunk in chat.stream(question):
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("get_weather", ARGUMENTS)]
    assert merged.response_metadata["finish_reason"] == "tool_calls"


# ----------------------------------------------------------------------------------------------------
# All or nothing
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_call_cut_by_the_budget_streams_as_content_at_the_end(server, tool_choice):
    syntax, client, backend = server
    backend.script = CALLS[syntax] if tool_choice == "auto" else FORCED
    budget = len(backend.tokenizer.encode(backend.script, add_special_tokens=False)) - 2
    body = {"tools": TOOLS, "tool_choice": tool_choice, "max_tokens": budget}
    whole = _whole(client, **body)
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    chunks = _chunks(client, **body)
    assert not any("tool_calls" in c["choices"][0]["delta"] for c in chunks)
    texts = [c["choices"][0]["delta"].get("content") or "" for c in chunks]
    assert "".join(texts) == whole["message"]["content"] and backend.script.startswith(whole["message"]["content"])
    assert [t for t in texts if t] == [whole["message"]["content"]], "held back, then released at the end"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_prose_before_an_auto_call_streams_as_content(server):
    syntax, client, backend = server
    backend.script = "Let me check.\n\n" + CALLS[syntax]
    whole = _whole(client, tools=TOOLS)
    chunks = _chunks(client, tools=TOOLS)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole["message"]["content"]
    assert whole["message"]["content"] == "Let me check."
    assert _named_calls(_check_streamed_form(chunks)) == _named_calls(whole["message"]["tool_calls"])


# ----------------------------------------------------------------------------------------------------
# The default model: the case, a real forced call streamed
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


def test_default_model_streamed_forced_call_equals_the_whole_one(default_server):
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from openai import OpenAI

    api = OpenAI(base_url=default_server.url + "/v1", api_key="unused", max_retries=0)
    ask = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    # One call (parallel_tool_calls false): left to itself the model repeats the call until the budget ends.
    body = {"model": "smollm2", "messages": ask, "tools": TOOLS, "temperature": 0, "max_tokens": 64,
            "parallel_tool_calls": False}
    for tool_choice in FORCED_CHOICES:
        whole = api.chat.completions.create(**body, tool_choice=tool_choice).choices[0]
        assert whole.finish_reason == "tool_calls", whole.message.content
        with api.chat.completions.stream(**body, tool_choice=tool_choice) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and final.message.tool_calls
        assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == [
            (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    chat = ChatOpenAI(model="smollm2", base_url=default_server.url + "/v1", api_key="unused", temperature=0,
                      max_tokens=64, max_retries=0).bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
    question = [HumanMessage(ask[0]["content"])]
    reply = chat.invoke(question)
    merged = None
    for chunk in chat.stream(question):
        merged = chunk if merged is None else merged + chunk
    assert reply.tool_calls and [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in reply.tool_calls]
