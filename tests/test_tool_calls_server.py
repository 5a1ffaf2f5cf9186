"""Tool calls and reasoning through the server, end to end, with the engine replaced by a scripted double.

Everything above the engine is real: the FastAPI app, ``OpenAIServing``, ``AsyncLLM``, the checkpoint's
tokenizer and chat template (the in-repo fixture tokenizer with the qwen3_5 or R1-distill template), the
output processor. Only the backend's engine loop is a double: it plays a scripted answer as token ids of
the real tokenizer, one ``on_output`` per token as the engine thread does, then EOS (or the budget). The
responses are checked through the ``openai`` and ``langchain-openai`` clients and as raw JSON.
"""

from __future__ import annotations

import json
import shutil
import time
from concurrent.futures import Future
from pathlib import Path

import pytest

from pocketllm.backends.base import EngineCaps
from pocketllm.engine.request import FinishReason, Request, RequestStatus
from pocketllm.runner.sampler import SampledToken

QWEN35_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3_5.jinja"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
THOUGHT_AND_CALL = "The user wants weather.\n</think>\n\n" + CALL


class _ScriptedLoop:
    """The engine loop's double: plays ``script`` (the answer text) for every request it is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.script = ""
        self.prompts: list[str] = []
        self.active: set[str] = set()

    def submit(self, request_id, prompt_token_ids, params, sink) -> Future:
        self.prompts.append(self.tokenizer.decode(prompt_token_ids, skip_special_tokens=False))
        ids = self.tokenizer.encode(self.script, add_special_tokens=False)
        eos = self.tokenizer.eos_token_id
        request = Request(request_id, list(prompt_token_ids), params, frozenset({eos}))
        for token in ids:
            request.output_token_ids.append(token)
            if len(request.output_token_ids) >= params.max_tokens:
                request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
            if sink.on_output(request, SampledToken(token)) and not request.is_finished:
                request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
            if request.is_finished:
                break
        else:
            request.output_token_ids.append(eos)
            request.status, request.finish_reason, request.stop_reason = (RequestStatus.FINISHED,
                                                                          FinishReason.STOP, eos)
            sink.on_output(request, SampledToken(eos))
        done: Future = Future()
        done.set_result(None)
        return done

    def abort(self, request_id) -> bool:
        return False


class _Core:
    max_model_len = 4096

    def stats(self) -> dict:
        return {}


class _ScriptedBackend:
    """A backend whose engine is the scripted loop; tokenizer and template are the checkpoint's own."""

    def __init__(self, model_dir: str, architecture: str) -> None:
        from pocketllm.tokenizer.tokenizer import Tokenizer

        self.model_path = model_dir
        self.tokenizer = Tokenizer.from_checkpoint_dir(model_dir)
        self.caps = EngineCaps(max_slots=8, details={"architecture": architecture})
        self.loop = _ScriptedLoop(self.tokenizer)
        self.core = _Core()

    def shutdown(self) -> None:
        pass


def _checkpoint(tmp_path_factory, r1_tokenizer, template: str | None, name: str) -> str:
    directory = tmp_path_factory.mktemp(name)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(r1_tokenizer.directory / file, directory / file)
    if template is not None:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    return str(directory)


def _serve(model_dir: str, architecture: str):
    """A running app over the scripted backend: (TestClient, backend)."""
    from fastapi.testclient import TestClient

    import pocketllm.api
    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app

    backend = _ScriptedBackend(model_dir, architecture)
    patch = pytest.MonkeyPatch()
    patch.setattr(pocketllm.api, "create_backend", lambda args: backend)
    client = TestClient(build_app(ServerConfig(EngineArgs(model=model_dir), served_model_name="tiny")))
    client.__enter__()
    deadline = time.monotonic() + 30
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.02)
    patch.undo()
    return client, backend


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, r1_tokenizer):
    template = QWEN35_TEMPLATE.read_text(encoding="utf-8")
    client, backend = _serve(_checkpoint(tmp_path_factory, r1_tokenizer, template, "q35"), "Qwen3ForCausalLM")
    yield client, backend
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def r1(tmp_path_factory, r1_tokenizer):
    client, backend = _serve(_checkpoint(tmp_path_factory, r1_tokenizer, None, "r1"), "Qwen2ForCausalLM")
    yield client, backend
    client.__exit__(None, None, None)


def _openai(client):
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)


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
    backend.loop.script = THOUGHT_AND_CALL
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
    assert '"name": "get_weather"' in backend.loop.prompts[-1]
    assert backend.loop.prompts[-1].endswith("<|im_start|>assistant\n<think>\n")


def test_prose_before_the_call_stays_content(qwen):
    client, backend = qwen
    backend.loop.script = "I'll check the forecast.\n\n" + CALL
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
    backend.loop.script = script
    choice = _post(client, messages=ASK, tools=[WEATHER])["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == script
    assert "tool_calls" not in choice["message"]


def test_call_cut_by_the_budget_stays_in_content(qwen):
    client, backend = qwen
    backend.loop.script = CALL
    budget = len(backend.tokenizer.encode(CALL, add_special_tokens=False)) - 2
    choice = _post(client, messages=ASK, tools=[WEATHER], max_tokens=budget)["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert CALL.startswith(choice["message"]["content"]) and choice["message"]["content"].startswith("<tool_call>")


def test_every_choice_gets_its_calls(qwen):
    client, backend = qwen
    backend.loop.script = CALL + "\n" + CALL.replace("Paris", "Rome").replace("\n3\n", "\n1\n")
    body = _post(client, messages=ASK, tools=[WEATHER], n=2)
    for choice in body["choices"]:
        calls = choice["message"]["tool_calls"]
        assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris", "days": 3},
                                                                          {"city": "Rome", "days": 1}]
        assert len({c["id"] for c in calls}) == 2


def test_stop_applies_to_the_answer_not_the_reasoning(qwen):
    client, backend = qwen
    backend.loop.script = "Paris in spring; STOP thinking.\n</think>\n\nMild, about 18 C. STOP here."
    choice = _post(client, messages=ASK, thinking_mode=True, stop=["STOP"])["choices"][0]
    assert choice["message"]["reasoning_content"] == "Paris in spring; STOP thinking."
    assert choice["message"]["content"] == "Mild, about 18 C. " and choice["finish_reason"] == "stop"


# ----------------------------------------------------------------------------------------------------
# The round trip with the openai client: the call replayed verbatim, the tool's result, an answer
# ----------------------------------------------------------------------------------------------------


def test_round_trip_with_openai(qwen):
    client, backend = qwen
    api = _openai(client)
    backend.loop.script = CALL
    first = api.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls"
    assistant = first.choices[0].message
    call = assistant.tool_calls[0]
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    backend.loop.script = "It will be sunny in Paris for the next 3 days."
    replay = [*ASK, assistant.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    second = api.chat.completions.create(model="tiny", messages=replay, tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "It will be sunny in Paris for the next 3 days."
    assert not second.choices[0].message.tool_calls
    # The template rendered the replayed call in its own syntax and the tool's result after it.
    prompt = backend.loop.prompts[-1]
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>") in prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt


def test_round_trip_raw_json_replayed_verbatim(qwen):
    client, backend = qwen
    backend.loop.script = THOUGHT_AND_CALL
    first = _post(client, messages=ASK, tools=[WEATHER], thinking_mode=True)
    assistant = first["choices"][0]["message"]
    backend.loop.script = "Sunny.\n</think>\n\nSunny all week."
    replay = [*ASK, assistant, {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                                "content": "sunny"}]
    second = _post(client, messages=replay, tools=[WEATHER], thinking_mode=True)
    assert second["choices"][0]["message"]["content"] == "Sunny all week."
    assert second["choices"][0]["finish_reason"] == "stop"
    assert "<think>\nThe user wants weather.\n</think>" in backend.loop.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# Streaming
# ----------------------------------------------------------------------------------------------------


def test_streamed_reasoning_and_tool_call_deltas(qwen):
    client, backend = qwen
    backend.loop.script = THOUGHT_AND_CALL
    stream = _openai(client).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True,
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
    (call,) = calls
    assert call.index == 0 and call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert reasons[-1] == "tool_calls"


def test_stream_equals_non_stream_when_the_call_does_not_parse(qwen):
    client, backend = qwen
    backend.loop.script = "Looking.\n\n" + CALL + "\nextra words"
    whole = _post(client, messages=ASK, tools=[WEATHER])["choices"][0]
    stream = _openai(client).chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole["message"]["content"] == backend.loop.script


# ----------------------------------------------------------------------------------------------------
# langchain-openai
# ----------------------------------------------------------------------------------------------------


def test_langchain_tool_call_round_trip(qwen):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    client, backend = qwen
    chat = ChatOpenAI(model="tiny", base_url="http://testserver/v1", api_key="unused", http_client=client,
                      max_retries=0)
    backend.loop.script = CALL
    question = HumanMessage(ASK[0]["content"])
    reply = chat.bind_tools([WEATHER]).invoke([question])
    assert reply.tool_calls == [{"name": "get_weather", "args": {"city": "Paris", "days": 3},
                                 "id": reply.tool_calls[0]["id"], "type": "tool_call"}]
    assert reply.response_metadata["finish_reason"] == "tool_calls"
    backend.loop.script = "Sunny."
    answer = chat.bind_tools([WEATHER]).invoke(
        [question, reply, ToolMessage("Sunny, 21 C", tool_call_id=reply.tool_calls[0]["id"])])
    assert answer.content == "Sunny." and answer.response_metadata["finish_reason"] == "stop"
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in backend.loop.prompts[-1]


# ----------------------------------------------------------------------------------------------------
# R1 distill: <think> reasoning, and a template that renders no tools
# ----------------------------------------------------------------------------------------------------


def test_r1_reasoning_split(r1):
    client, backend = r1
    backend.loop.script = "<think>\nTwo and two.\n</think>\n\nFour."
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
    backend.loop.script = CALL  # a syntax this checkpoint's template does not write: left in content
    choice = _post(client, messages=ASK)["choices"][0]
    assert choice["message"]["content"] == CALL and choice["finish_reason"] == "stop"
