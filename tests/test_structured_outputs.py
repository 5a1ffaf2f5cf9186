"""Structured outputs: the token bitmask, grammar matchers, response_format and forced tool_choice.

Unit tests run on a tiny hand-made vocabulary; the real default model (SmolLM2) checks that constrained
answers validate against their schemas (greedy, sampled, many seeds, under preemption), and one server
checks forced tool calls through the ``openai`` client, including the tool-result round trip.
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.protocol.openai_fields import parse_chat_request
from pocketllm.protocol.structured_output import (
    after_reasoning,
    check_tool_choice,
    forced_tool_call_schema,
    parse_forced_tool_calls,
    structured_output_for,
)
from pocketllm.runner.grammar import GrammarCompiler, apply_bitmask, fill_bitmask, xgrammar_available
from pocketllm.runner.sampler import Sampler, SamplingRow
from pocketllm.sampling_params import SamplingParams, StructuredOutput

pytestmark = pytest.mark.skipif(not xgrammar_available(), reason="xgrammar is not installed")

jsonschema = pytest.importorskip("jsonschema") if xgrammar_available() else None


def valid(instance: Any, schema: dict) -> bool:
    jsonschema.validate(instance, schema)
    return True


# ----------------------------------------------------------------------------------------------------
# Tiny vocabulary: the mask, the matcher, the sampler hook
# ----------------------------------------------------------------------------------------------------

EOS = 0
TINY_VOCAB = [b"", b"{", b"}", b'"', b"a", b"b", b":", b",", b" ", b"1", b"2", b'{"a":', b"x", b"<tool>",
              b"<think>", b"</think>"]
TINY_SPECIAL = {EOS, 13, 14, 15}  # added tokens: never inside the text
SCHEMA_A = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def tiny_compiler(vocab_size: int = 40) -> GrammarCompiler:
    return GrammarCompiler(lambda: list(TINY_VOCAB), TINY_SPECIAL, vocab_size, [EOS])


def allowed_ids(matcher, width: int) -> set[int]:
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    matcher.fill(bitmask, 0)
    return {t for t in range(width * 32) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1}


def test_apply_bitmask_sets_disallowed_logits_to_minus_inf():
    vocab = 70  # three int32 words, the last one partly used
    allowed = [{1, 33, 69}, {0, 31, 32, 64}]
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    for row, ids in enumerate(allowed):
        for t in ids:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # bit 31 is the sign bit
    logits = torch.randn(3, vocab)
    before = logits.clone()
    apply_bitmask(logits, bitmask, rows=[2, 0])  # bitmask row i masks logits row rows[i]
    assert torch.equal(logits[1], before[1])  # untouched row
    for logit_row, ids in ((2, allowed[0]), (0, allowed[1])):
        for t in range(vocab):
            if t in ids:
                assert logits[logit_row, t] == before[logit_row, t]
            else:
                assert logits[logit_row, t] == -math.inf
    narrow = torch.full((1, 1), -1, dtype=torch.int32)  # covers 32 tokens: the rest are disallowed
    x = torch.zeros(1, vocab)
    apply_bitmask(x, narrow)
    assert torch.isfinite(x[0, :32]).all() and torch.isinf(x[0, 32:]).all()


def test_matcher_allows_eos_only_when_the_grammar_is_complete():
    compiler = tiny_compiler()
    so = StructuredOutput(json_schema=SCHEMA_A)
    matcher = compiler.matcher(so)
    width = compiler.bitmask_width
    first = allowed_ids(matcher, width)
    assert first == {1, 11}  # "{" or '{"a":'
    assert EOS not in first and 13 not in first
    for token in (11, 8, 9, 10):  # {"a": 12 (compact separators: ", " and ": ")
        assert matcher.accept(token)
        assert EOS not in allowed_ids(matcher, width)
    assert not matcher.accept(12)  # "x" cannot follow a number; the state is unchanged
    assert matcher.accept(2) and matcher.is_completed  # }
    assert allowed_ids(matcher, width) == {EOS}
    assert matcher.accept(EOS) and matcher.is_terminated
    assert matcher.num_accepted == 6
    assert compiler.compile(so) is compiler.compile(StructuredOutput(json_schema=dict(SCHEMA_A)))  # cached
    assert len(compiler) == 1
    with_stop = compiler.matcher(so, extra_stop_token_ids=[12])
    for token in (11, 8, 9, 2):
        assert with_stop.accept(token)
    assert allowed_ids(with_stop, width) == {EOS, 12}  # a request's stop_token_ids end it like EOS


def test_grammar_starts_after_the_reasoning_block():
    compiler = tiny_compiler()
    width = compiler.bitmask_width
    inside = compiler.matcher(StructuredOutput(json_schema=SCHEMA_A, reasoning=("<think>", "</think>"),
                                               in_reasoning=True))
    bitmask = torch.full((1, width), -1, dtype=torch.int32)
    assert not inside.fill(bitmask, 0) and (bitmask == -1).all()  # free text while reasoning
    for token in (12, 4, 3, 15):  # ... </think>
        assert inside.accept(token)
    assert allowed_ids(inside, width) == {1, 11}  # the answer is the grammar's
    assert not inside.accept(12) and inside.num_accepted == 4
    may_open = compiler.matcher(StructuredOutput(json_schema=SCHEMA_A, reasoning=("<think>", "</think>")))
    assert allowed_ids(may_open, width) == {1, 11, 14}  # open the block, or answer at once
    assert may_open.accept(14) and may_open.accept(12) and may_open.accept(15)
    assert allowed_ids(may_open, width) == {1, 11}
    direct = compiler.matcher(StructuredOutput(json_schema=SCHEMA_A, reasoning=("<think>", "</think>")))
    assert direct.accept(11) and allowed_ids(direct, width) == {8}  # answered at once: the grammar holds
    with pytest.raises(InvalidRequestError):
        compiler.matcher(StructuredOutput(json_object=True, reasoning=("<thought>", "</thought>")))
    with pytest.raises(InvalidRequestError):
        StructuredOutput(json_object=True, in_reasoning=True)  # needs the markers

    so = StructuredOutput(json_object=True)
    syntax = SimpleNamespace(start="<think>", end="</think>")
    assert after_reasoning(so, None) is so
    assert after_reasoning(so, SimpleNamespace(reasoning=syntax, reasoning_state="answer")) is so
    inside_so = after_reasoning(so, SimpleNamespace(reasoning=syntax, reasoning_state="inside"))
    assert inside_so.reasoning == ("<think>", "</think>") and inside_so.in_reasoning
    assert not after_reasoning(so, SimpleNamespace(reasoning=syntax, reasoning_state="open")).in_reasoning


def test_fill_bitmask_reports_when_nothing_is_restricted():
    compiler = tiny_compiler()
    matcher = compiler.matcher(StructuredOutput(json_object=True))
    bitmask = fill_bitmask([matcher, compiler.matcher(StructuredOutput(json_schema=SCHEMA_A))],
                           compiler.bitmask_width)
    assert bitmask is not None and bitmask.shape == (2, compiler.bitmask_width)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampler_masks_grammar_rows_and_keeps_raw_logprobs(temperature):
    compiler = tiny_compiler()
    vocab = 40
    logits = torch.zeros(2, vocab)
    logits[:, 12] = 50.0  # "x" dominates, but the grammar only allows "{" or '{"a":'
    logits[:, 1] = 1.0
    so = StructuredOutput(json_schema=SCHEMA_A)
    params = SamplingParams(temperature=temperature, logprobs=2, structured_output=so, seed=3)
    plain = SamplingParams(temperature=temperature, logprobs=2)
    gen = torch.Generator().manual_seed(3) if temperature else None
    rows = [SamplingRow(params, [5], [], gen, compiler.matcher(so)), SamplingRow(plain, [5], [])]
    out = Sampler(seed=0)(logits, rows)
    assert out[0].token_id in (1, 11)
    assert out[1].token_id == 12 or temperature > 0
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out[0].logprob == pytest.approx(float(raw[out[0].token_id]))  # raw distribution, not the masked one
    assert out[0].top_ids[0] == 12  # the ranking sees the unmasked logits
    # Penalties and bias apply after the mask: a disallowed token stays disallowed.
    biased = SamplingParams(temperature=temperature, logit_bias={12: 100.0, 1: -5.0}, repetition_penalty=1.3,
                            structured_output=so)
    assert Sampler(seed=0)(logits[:1], [SamplingRow(biased, [12], [12], None, compiler.matcher(so))])[0].token_id \
        in (1, 11)


def test_structured_output_is_validated_at_construction():
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput(json_schema={"type": "objectx"})
    assert info.value.param == "response_format" and "grammar" in str(info.value)
    assert "/" not in str(info.value).split("grammar:")[1]  # xgrammar's source location is not shown
    for bad in ({}, {"json_schema": [1]}, {"json_schema": "{nope"}, {"json_schema": SCHEMA_A, "json_object": True},
                {"json_object": "yes"}, {"json_object": True, "strict": "no"}):
        with pytest.raises(InvalidRequestError):
            StructuredOutput(**bad)
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput(json_schema={"$ref": "#/nowhere"}, param="tools")
    assert info.value.param == "tools"
    so = StructuredOutput(json_schema={"type": "object", "properties": {"z": {}, "a": {}}})
    assert list(so.schema["properties"]) == ["z", "a"]  # declared order is kept (properties come out in it)
    assert so == StructuredOutput(json_schema=json.dumps(so.schema)) and hash(so) == hash(StructuredOutput(
        json_schema=so.schema))
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(structured_output=so, ignore_eos=True)
    assert info.value.param == "ignore_eos"
    with pytest.raises(InvalidRequestError):
        SamplingParams(structured_output={"type": "object"})
    with pytest.raises(AttributeError):
        so.json_object = True  # frozen


# ----------------------------------------------------------------------------------------------------
# Protocol: response_format, tool_choice, the forced-call schema and its parsing
# ----------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}},
                                       "required": ["zone"], "$defs": {"zone": {"type": "string", "maxLength": 20}}}}}
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_time"}}
ON = SimpleNamespace(structured_outputs=True)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_TOOLS = "{% if tools %}TOOLS:{{ tools | length }}\n{% endif %}" + CHATML
USER = [{"role": "user", "content": "hi"}]


def test_forced_tool_call_schema():
    schema = forced_tool_call_schema(TOOLS, "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["const"] for item in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["$defs"] == {"zone": {"type": "string", "maxLength": 20}}  # lifted so the $ref resolves
    assert "$defs" in CLOCK["function"]["parameters"]  # the caller's tools are not touched
    one = forced_tool_call_schema(TOOLS, NAMED)
    assert one["maxItems"] == 1 and one["items"]["properties"]["name"] == {"const": "get_time"}
    assert forced_tool_call_schema(TOOLS, "required", parallel_tool_calls=False)["maxItems"] == 1
    calls = [{"name": "get_time", "arguments": {"zone": "UTC"}},
             {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]
    valid(calls, schema)
    with pytest.raises(jsonschema.ValidationError):
        valid([{"name": "get_time", "arguments": {"city": "Paris"}}], schema)
    so = structured_output_for({"tools": TOOLS, "tool_choice": "required"})
    assert so.param == "tools" and so.schema == schema
    clash = {"type": "function", "function": {"name": "other", "parameters": {
        "type": "object", "$defs": {"zone": {"type": "integer"}}}}}
    with pytest.raises(InvalidRequestError) as info:
        forced_tool_call_schema([CLOCK, clash], "required")
    assert info.value.param == "tools"


def test_parse_forced_tool_calls_is_all_or_nothing():
    calls = parse_forced_tool_calls('[{"name": "get_time", "arguments": {"zone": "UTC"}}, '
                                    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]')
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert len({c["id"] for c in calls}) == 2
    for text in ('[{"name": "get_time", "arguments": {"zone": "UT', "[]", '{"name": "f", "arguments": {}}',
                 '[{"name": "f"}]', '[{"name": 3, "arguments": {}}]', '[{"name": "f", "arguments": "{}"}]', "hi"):
        assert parse_forced_tool_calls(text) is None, text


def test_tool_choice_rules():
    assert check_tool_choice(None, TOOLS, structured_outputs=False) == "auto"
    assert check_tool_choice("none", TOOLS, False, structured_outputs=False) == "none"
    assert check_tool_choice("required", TOOLS, False, structured_outputs=True) == "required"
    assert check_tool_choice(NAMED, TOOLS, structured_outputs=True) == "named"
    cases = [("required", TOOLS, None, False, "tool_choice"),  # no grammar engine
             ("required", None, None, True, "tool_choice"),  # nothing to call
             ({"type": "function", "function": {"name": "nope"}}, TOOLS, None, True, "tool_choice"),
             ("sometimes", TOOLS, None, True, "tool_choice"),
             ("auto", TOOLS, False, True, "parallel_tool_calls"),  # the model's own syntax is not limited
             ("required", TOOLS, "no", True, "parallel_tool_calls")]
    for choice, tools, parallel, caps, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            check_tool_choice(choice, tools, parallel, structured_outputs=caps)
        assert info.value.param == param, (choice, parallel)
        assert f'"{param}"' in str(info.value)


def test_openai_fields_with_structured_outputs():
    body = {"messages": USER, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}
    parsed = parse_chat_request(body, ON)
    assert parsed.chat_options["tool_choice"] == "required" and parsed.chat_options["parallel_tool_calls"] is False
    assert structured_output_for(parsed.chat_options).schema["maxItems"] == 1
    assert parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "none"}, None).chat_options
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA_A, "strict": True}}
    so = structured_output_for(parse_chat_request({"messages": USER, "response_format": fmt}, ON).chat_options)
    assert so.schema == SCHEMA_A and so.strict is True and so.param == "response_format"
    refusals = [({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
                ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA_A, "strict": 1}}},
                 "response_format"),
                ({"response_format": {"type": "json_object"}, "tools": TOOLS, "tool_choice": "required"},
                 "response_format"),
                ({"tools": TOOLS, "tool_choice": NAMED | {"function": {"name": "x"}}}, "tool_choice"),
                ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls")]
    for extra, param in refusals:
        with pytest.raises(InvalidRequestError) as info:
            parse_chat_request({"messages": USER, **extra}, ON)
        assert info.value.param == param, extra
    with pytest.raises(InvalidRequestError) as info:
        parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": "required"}, None)
    assert info.value.param == "tool_choice"


def test_chat_builder_renders_tools_by_choice():
    assert "TOOLS:2" in build_chat_prompt(CHATML_TOOLS, USER, tools=TOOLS)
    assert "TOOLS" not in build_chat_prompt(CHATML_TOOLS, USER, tools=TOOLS, tool_choice="none")
    assert "TOOLS:2" in build_chat_prompt(CHATML_TOOLS, USER, tools=TOOLS, tool_choice="required",
                                          structured_outputs=True)
    with pytest.raises(InvalidRequestError) as info:  # auto on a template without tools stays a 400
        build_chat_prompt(CHATML, USER, tools=TOOLS)
    assert info.value.param == "tools"
    assert build_chat_prompt(CHATML, USER, tools=TOOLS, tool_choice="none") == build_chat_prompt(CHATML, USER)
    forced = build_chat_prompt(CHATML, USER, tools=TOOLS, tool_choice=NAMED, structured_outputs=True)
    assert forced == build_chat_prompt(CHATML, USER)  # the grammar carries the tools
    for options, param in (({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
                           ({"response_format": {"type": "json_object"}}, "response_format")):
        with pytest.raises(InvalidRequestError) as info:
            build_chat_prompt(CHATML, USER, **options)  # the engine declares no structured outputs
        assert info.value.param == param
    build_chat_prompt(CHATML, USER, response_format={"type": "json_object"}, structured_outputs=True)


# ----------------------------------------------------------------------------------------------------
# The real default model
# ----------------------------------------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
CITY = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16}, "capital": {"type": "boolean"},
    "population_millions": {"type": "number"},
    "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 2}},
    "required": ["city", "capital", "landmarks"]}
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
         "required": ["color", "hex"]}
SCHEMAS = [("Describe a person as JSON.", PERSON), ("Describe Paris as JSON.", CITY),
           ("Pick a color and give its hex code as JSON.", COLOR)]


@pytest.fixture(scope="module")
def server_process(smollm2_gguf):
    """The module's server, started early so that it loads while the library tests run."""
    from server_utils import ServerProcess

    proc = ServerProcess("--served-model-name", "smollm2")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llm(smollm2_gguf, server_process):
    from pocketllm import LLM
    from pocketllm.config import EngineArgs

    # A small KV pool (24 blocks of 16 tokens) so that a batch of constrained requests gets preempted; async
    # scheduling (the CUDA default) so that grammar rows are seen to wait for their previous token.
    with LLM(EngineArgs(model=smollm2_gguf, num_kv_blocks=24, max_num_seqs=24, async_scheduling="on")) as engine:
        yield engine


def chat_ids(llm, question: str) -> list[int]:
    return llm.tokenizer.encode(llm.render_chat([{"role": "user", "content": question}]), add_special_tokens=False)


def test_greedy_outputs_validate(llm):
    """Three schemas and a json_object, greedy, run concurrently (each request has its own matcher)."""
    assert llm.engine_caps().structured_outputs is True

    def one(job):
        question, schema = job
        if schema is None:
            return llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=48),
                            response_format={"type": "json_object"})[0]
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
        return llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0, max_tokens=48),
                        response_format=fmt)[0]

    jobs = [*SCHEMAS, ("What is the capital of France? Answer in JSON.", None)]
    with ThreadPoolExecutor(len(jobs)) as pool:
        outputs = list(pool.map(one, jobs))
    for (_, schema), out in zip(jobs, outputs):
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        assert isinstance(value, dict)
        if schema is not None:
            valid(value, schema)
        assert llm.tokenizer.eos_token_id not in out.token_ids[:-1]


def test_twenty_seeds_valid_under_preemption(llm):
    """20 sampled requests, each with its own seed, batched on a KV pool too small for all of them."""
    question, schema = SCHEMAS[0]
    ids = chat_ids(llm, question)
    so = StructuredOutput(json_schema=schema)
    before = llm._client.stats()["num_preemptions"]

    def one(seed: int):
        # The schema does not bound a string's length: at temperature 1 about one sample in 40 runs past 28
        # tokens (measured), so the budget leaves room for a long name rather than relying on the seeds' luck.
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=48, structured_output=so)
        return llm.generate([ids], params)[0]

    with ThreadPoolExecutor(20) as pool:
        outputs = list(pool.map(one, range(20)))
    assert llm._client.stats()["num_preemptions"] > before, "the small KV pool should have forced preemption"
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        valid(json.loads(out.text), schema)
    assert len({out.text for out in outputs}) > 5  # independent samples


def test_library_chat_forced_tool_call(llm):
    out = llm.chat([{"role": "user", "content": "What's the weather in Paris?"}],
                   SamplingParams(temperature=0, max_tokens=48), tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "get_weather"}})[0]
    calls = parse_forced_tool_calls(out.text)
    assert calls and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather", out.text
    valid(json.loads(calls[0]["function"]["arguments"]), WEATHER["function"]["parameters"])
    with pytest.raises(InvalidRequestError):
        llm.chat(USER, tools=TOOLS)  # auto on SmolLM2's template: no tool support


# ----------------------------------------------------------------------------------------------------
# Through the server
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(server_process):
    server_process.wait_ready()
    return server_process


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused")


WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris today, in celsius?"}]


def check_call(call, tools=TOOLS) -> dict:
    assert call.type == "function" and call.id
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    arguments = json.loads(call.function.arguments)
    valid(arguments, spec["parameters"])
    return arguments


def test_server_forced_tool_call_round_trip(client):
    from openai.types.chat import ChatCompletion

    response = client.chat.completions.create(model="smollm2", messages=WEATHER_Q, tools=TOOLS,
                                              tool_choice="required", temperature=0, max_tokens=64)
    assert isinstance(response, ChatCompletion)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_call(call)
    # The spec's round trip: the assistant message replayed verbatim, a tool result keyed on its id.
    assistant = choice.message.model_dump(exclude_none=True)
    results = [{"role": "tool", "tool_call_id": call.id, "content": "18 degrees celsius, sunny"}
               for call in choice.message.tool_calls]
    answer = client.chat.completions.create(model="smollm2", messages=WEATHER_Q + [assistant] + results,
                                            tools=TOOLS, tool_choice="none", temperature=0, max_tokens=48)
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def test_langchain_forced_tool_call_round_trip(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(model="smollm2", base_url=server.url + "/v1", api_key="unused", temperature=0, max_tokens=64,
                      max_retries=0)
    question = HumanMessage(WEATHER_Q[0]["content"])
    reply = chat.bind_tools(TOOLS, tool_choice="required").invoke([question])
    assert reply.response_metadata["finish_reason"] == "tool_calls" and reply.tool_calls
    for call in reply.tool_calls:
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
        valid(call["args"], spec["parameters"])
    results = [ToolMessage("18 degrees celsius, sunny", tool_call_id=call["id"]) for call in reply.tool_calls]
    answer = chat.bind_tools(TOOLS, tool_choice="none").invoke([question, reply, *results])
    assert answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] == "stop"


def test_server_named_tool_choice_each_choice_its_own_grammar(client):
    response = client.chat.completions.create(model="smollm2", messages=WEATHER_Q, tools=TOOLS, n=3, seed=11,
                                              tool_choice={"type": "function", "function": {"name": "get_time"}},
                                              temperature=1.0, max_tokens=48, parallel_tool_calls=False)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert len(choice.message.tool_calls) == 1
        assert choice.message.tool_calls[0].function.name == "get_time"
        check_call(choice.message.tool_calls[0])


def test_server_response_format(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    response = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A person?"}],
                                              response_format=fmt, n=2, temperature=0.7, seed=5, max_tokens=40)
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        valid(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "A person?"}],
                                            response_format={"type": "json_object"}, temperature=0, max_tokens=40,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert isinstance(json.loads(text), dict)
    bad = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": USER, "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "response_format"
    auto = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={"messages": USER, "tools": TOOLS})
    assert auto.status_code == 400 and auto.json()["error"]["param"] == "tools"


def test_forced_call_replayed_on_a_template_without_tools():
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]}
    messages = [*USER, assistant, {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    snapshot = json.dumps(messages)
    text = build_chat_prompt(CHATML, messages, tools=TOOLS, tool_choice="none")
    assert '<|im_start|>assistant\n[{"name": "get_time", "arguments": {"zone": "UTC"}}]<|im_end|>' in text
    assert "<|im_start|>tool\nnoon<|im_end|>" in text
    assert json.dumps(messages) == snapshot  # the caller's messages are not touched

