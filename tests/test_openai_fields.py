"""The OpenAI request-field policy: every row of the table, refusals with their param, defaults accepted."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from pocketllm.errors import InvalidRequestError
from pocketllm.protocol.openai_fields import (
    CHAT,
    COMPLETIONS,
    FIELD_POLICY,
    IMPLEMENTED,
    INERT,
    MAX_CHOICES,
    MAX_N,
    REFUSED_AT_VALUE,
    RESPONSES,
    ParsedRequest,
    parse_chat_request,
    parse_completion_request,
)
from pocketllm.protocol.responses_request import parse_responses_request
from pocketllm.sampling_params import SamplingParams

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PARSERS = {CHAT: parse_chat_request, COMPLETIONS: parse_completion_request,
           RESPONSES: lambda body, caps: parse_responses_request(body, caps).chat}
BASE = {CHAT: {"messages": MESSAGES}, COMPLETIONS: {"prompt": "Once upon a time"},
        RESPONSES: {"input": "What is the capital of France?"}}

# Every documented OpenAI request field (openai-python 3.57 CompletionCreateParams) plus `stream`.
OPENAI_CHAT_FIELDS = {
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "moderation", "n", "parallel_tool_calls",
    "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
    "reasoning_effort", "response_format", "safety_identifier", "seed", "service_tier", "stop", "store", "stream",
    "stream_options", "temperature", "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options",
}
OPENAI_COMPLETION_FIELDS = {
    "model", "prompt", "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user",
}
# openai-python 3.57 ResponseCreateParams, plus `stream`.
OPENAI_RESPONSES_FIELDS = {
    "access_programs", "background", "background_options", "context_management", "conversation", "image", "include",
    "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model", "moderation",
    "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store", "stream", "stream_options",
    "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p", "truncation", "user",
}
EXTENSIONS_BOTH = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids", "request_id"}
EXTENSIONS_CHAT = {"thinking_mode", "add_generation_prompt", "drop_thinking", "chat_template_kwargs"}


def parse(endpoint: str, caps: Any = None, **fields: Any) -> ParsedRequest:
    return PARSERS[endpoint]({**BASE[endpoint], **fields}, caps)


_NO_BODY = object()


def refused(endpoint: str, param: str | None, caps: Any = None, body: Any = _NO_BODY,
            **fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        PARSERS[endpoint]({**BASE[endpoint], **fields} if body is _NO_BODY else body, caps)
    assert info.value.param == param, (info.value.param, str(info.value))
    return info.value


# ----------------------------------------------------------------------------------------------------
# The table
# ----------------------------------------------------------------------------------------------------


def test_table_covers_every_documented_field_and_nothing_else():
    assert set(FIELD_POLICY[CHAT]) == OPENAI_CHAT_FIELDS | EXTENSIONS_BOTH | EXTENSIONS_CHAT
    assert set(FIELD_POLICY[COMPLETIONS]) == OPENAI_COMPLETION_FIELDS | EXTENSIONS_BOTH | {"top_logprobs"}
    assert set(FIELD_POLICY[RESPONSES]) == OPENAI_RESPONSES_FIELDS
    for endpoint, table in FIELD_POLICY.items():
        for name, rule in table.items():
            assert rule.kind in (IMPLEMENTED, REFUSED_AT_VALUE, INERT), (endpoint, name)
            assert rule.summary, (endpoint, name)
            assert rule.extension == (name in EXTENSIONS_BOTH | EXTENSIONS_CHAT), (endpoint, name)
            if rule.kind == REFUSED_AT_VALUE:
                assert rule.neutral and rule.reason and rule.advice, (endpoint, name)


def test_classes_match_the_policy():
    kinds = {e: {k: {n for n, r in t.items() if r.kind == k} for k in (IMPLEMENTED, REFUSED_AT_VALUE, INERT)}
             for e, t in FIELD_POLICY.items()}
    assert kinds[CHAT][INERT] == {"model", "user", "metadata", "service_tier", "prompt_cache_key",
                                  "prompt_cache_retention", "prompt_cache_options", "safety_identifier"}
    assert kinds[CHAT][REFUSED_AT_VALUE] == {"audio", "modalities", "prediction", "web_search_options", "functions",
                                             "function_call", "verbosity", "moderation", "stream_options", "store"}
    # Enforced with structured-output grammars (refused per value when the engine lacks them).
    assert FIELD_POLICY[CHAT]["tool_choice"].kind == IMPLEMENTED
    assert FIELD_POLICY[CHAT]["parallel_tool_calls"].kind == IMPLEMENTED
    assert kinds[COMPLETIONS][INERT] == {"model", "user"}
    assert kinds[COMPLETIONS][REFUSED_AT_VALUE] == {"best_of", "suffix", "echo", "top_logprobs", "stream_options"}
    for endpoint in (CHAT, COMPLETIONS):  # PocketLLM implements these, unlike the spec's server
        for name in ("frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty"):
            assert FIELD_POLICY[endpoint][name].kind == IMPLEMENTED


def behaviour(request: ParsedRequest) -> tuple:
    """What the engine and the response shaping receive from a parsed request (the sampling as the engine's
    SamplingParams, so a field spelled with its default value compares equal to the field left out)."""
    sampling = dict(request.sampling)
    max_tokens = sampling.pop("max_tokens", None)
    return (request.endpoint, request.messages, request.prompts, SamplingParams(**sampling, max_tokens=16),
            max_tokens, request.n, request.stream, request.want_logprobs, request.chat_options,
            request.request_id, request.drop_thinking, request.include_usage)


@pytest.mark.parametrize("endpoint,name", [(e, n) for e, t in FIELD_POLICY.items() for n in t])
def test_null_is_absent_for_every_optional_field(endpoint, name):
    if name in BASE[endpoint]:
        refused(endpoint, name, **{name: None})  # the required field cannot be null
    else:
        assert behaviour(parse(endpoint, **{name: None})) == behaviour(parse(endpoint))


@pytest.mark.parametrize("endpoint,name,value", [
    (e, n, v) for e, t in FIELD_POLICY.items() for n, r in t.items() if r.kind == REFUSED_AT_VALUE
    for v in r.neutral])
def test_neutral_value_of_every_refused_field_is_accepted(endpoint, name, value):
    assert behaviour(parse(endpoint, **{name: value})) == behaviour(parse(endpoint))
    streamed = parse(endpoint, stream=True, **{name: value})
    bare = parse(endpoint, stream=True)
    if name == "stream_options":  # the one neutral value that asks for something: the usage chunk of a stream
        assert streamed.include_usage is (isinstance(value, dict) and value.get("include_usage") is True)
        bare = dataclasses.replace(bare, include_usage=streamed.include_usage)
    assert behaviour(streamed) == behaviour(bare)


INERT_VALUES = {"model": "gpt-4o", "user": "alice", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
                "prompt_cache_key": "abc", "prompt_cache_retention": "24h",
                "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "safety_identifier": "h1",
                "max_tool_calls": 3}


@pytest.mark.parametrize("endpoint,name", [(e, n) for e, t in FIELD_POLICY.items() for n, r in t.items()
                                           if r.kind == INERT])
def test_inert_fields_accepted_and_ignored(endpoint, name):
    plain = parse(endpoint)
    assert parse(endpoint, **{name: INERT_VALUES[name]}) == plain
    refused(endpoint, name, **{name: 12345 if name not in ("store", "max_tool_calls") else "yes"})


# field -> values refused on a bare request (non-streaming)
REFUSALS: dict[str, dict[str, list[Any]]] = {
    CHAT: {
        "stop": [5, [1], ["a", 2], {"x": 1}, True],
        "logprobs": [1, 5, "true"],
        "top_logprobs": [21, -1, 1.5, True, "3"],
        "tool_choice": ["required", {"type": "function", "function": {"name": "f"}}, "any", 3,
                        {"type": "function"}, {"type": "allowed_tools", "allowed_tools": {}}],
        "parallel_tool_calls": [False, "yes"],
        "audio": [{"voice": "alloy", "format": "wav"}],
        "modalities": [["text", "audio"], ["audio"], [], "text"],
        "prediction": [{"type": "content", "content": "x"}],
        "web_search_options": [{}, {"search_context_size": "low"}],
        "functions": [[{"name": "f", "parameters": {}}]],
        "function_call": ["auto", "none", {"name": "f"}],
        "verbosity": ["low", "medium"],
        "moderation": [{"model": "omni-moderation-latest"}],
        "stream_options": ["yes", {"bogus": True}, {"include_usage": "yes"}],
        "messages": ["hi", [], ["hi"], [{"content": "no role"}], {"role": "user"}],
        "max_tokens": [0, -1, 1.5, "10", True],
        "max_completion_tokens": [0, -1, "10"],
        "temperature": ["hot", -0.1, 2.5, True, float("nan")],
        "top_p": [0, 1.5, "x"],
        "seed": [1.5, "1", True, 2**64],
        "n": [0, -1, MAX_N + 1, 1.5, True, "2"],
        "stream": ["yes", 1],
        "frequency_penalty": [2.5, -3, "x"],
        "presence_penalty": [2.01, True],
        "repetition_penalty": [0, -1, "x"],
        "logit_bias": [[1], {"abc": 1}, {"-1": 1}, {"5": 101}, {"5": "x"}, {"9" * 5000: 1}],
        "top_k": [-2, 1.5, "x"],
        "min_p": [-0.1, 1.1],
        "ignore_eos": [1, "true"],
        "stop_token_ids": [5, [-1], ["a"], [True], [2**31]],
        "store": [True, "yes"],
        "metadata": [{"a": 1}, {"a": float("nan")}, {"a": {"b": "c"}}, {"k" * 65: "v"}, {"a": "v" * 513},
                     {f"k{i}": "v" for i in range(17)}, ["a"]],
        "service_tier": ["bogus", "priority", "flex", 5],
        "response_format": ["json", {"type": "xml"}, {"type": "json_schema"},
                            {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "x"}}],
        "tools": [{"type": "function"}, [{"type": "custom", "custom": {"name": "x"}}], [{"type": "function"}],
                  ["f"]],
        "reasoning_effort": ["extreme", 3],
        "thinking_mode": ["on"],
        "add_generation_prompt": [0],
        "drop_thinking": ["no"],
        "request_id": ["", 5, "a/b", "a b", "x" * 300],
        "chat_template_kwargs": ["x", {"messages": []}, {"add_generation_prompt": False}],
    },
    RESPONSES: {
        "input": [5, [], ["hi"], [{"role": "tool", "content": "x"}], [{"type": "item_reference", "id": "r"}],
                  [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
                  [{"type": "function_call", "name": "f"}], [{"type": "function_call_output", "output": "x"}],
                  [{"role": "system", "content": "only instructions"}]],
        "instructions": [5],
        "tools": [{"type": "function"}, [{"type": "web_search"}], [{"type": "function"}],
                  [{"type": "function", "name": "f", "defer_loading": True}]],
        "tool_choice": ["required", "any", {"type": "function", "name": "f"}, {"type": "allowed_tools", "tools": []},
                        {"type": "file_search"}],
        "parallel_tool_calls": [False, "yes"],
        "text": ["json", {"format": {"type": "xml"}}, {"format": {"type": "json_schema"}}, {"verbosity": "low"},
                 {"format": {"type": "json_object"}}, {"other": 1}],
        "reasoning": ["high", {"effort": "extreme"}, {"summary": "auto"}, {"generate_summary": "concise"},
                      {"mode": "pro"}],
        "max_output_tokens": [0, -1, 1.5, "10", True],
        "temperature": ["hot", -0.1, 2.5],
        "top_p": [0, 1.5],
        "stream": ["yes", 1],
        "store": [True, "yes"],
        "metadata": [{"a": 1}, {"a": float("inf")}, {f"k{i}": "v" for i in range(17)}],
        "service_tier": ["bogus", "scale"],
        "previous_response_id": ["resp_1"],
        "conversation": ["conv_1", {"id": "conv_1"}],
        "background": [True],
        "background_options": [{"completion_window": "2h"}],
        "include": [["message.output_text.logprobs"], ["reasoning.encrypted_content"]],
        "top_logprobs": [1, 20],
        "prompt": [{"id": "pmpt_1"}],
        "truncation": ["auto"],
        "context_management": [[{"type": "compaction"}]],
        "moderation": [{"model": "omni-moderation-latest"}],
        "stream_options": [{"include_obfuscation": True}, {"include_usage": True}],
        "access_programs": [{"cyber": "standard"}],
        "image": [{"context_compression": "auto"}],
    },
    COMPLETIONS: {
        "prompt": [5, [], ["a", 1], [1, "a"], [[1, 2], "a"], [[]], [-1], [True], [[1], [1.5]], {"p": 1},
                   ["a"] * (MAX_CHOICES + 1)],
        "logprobs": [True, False, 21, -1, 1.5, "1"],
        "top_logprobs": [0, 1, 5],
        "best_of": [2, 0, True, "1"],
        "suffix": ["tail"],
        "echo": [True, "false"],
        "stop": [5, [None]],
        "max_tokens": [0, "x"],
        "n": [0, MAX_N + 1],
        "temperature": [3],
        "logit_bias": [{"x": 1}],
        "stream_options": [{"include_usage": 1}],
    },
}


@pytest.mark.parametrize("endpoint,name,value", [
    (e, n, v) for e, rows in REFUSALS.items() for n, vs in rows.items() for v in vs])
def test_refusal_names_the_field(endpoint, name, value):
    err = refused(endpoint, name, **{name: value})
    assert f'"{name}"' in str(err)
    assert "Send" in str(err) or "send" in str(err) or "Remove" in str(err) or "Omit" in str(err)


def test_every_refused_at_value_row_has_a_refusal_case():
    for endpoint, table in FIELD_POLICY.items():
        for name, rule in table.items():
            if rule.kind == REFUSED_AT_VALUE:
                assert REFUSALS[endpoint].get(name), (endpoint, name)


def test_stop_message_follows_the_spec():
    err = refused(CHAT, "stop", stop=5)
    assert str(err) == ('"stop" = 5 is not supported by this server: a stop sequence is a string, or a list of '
                        'strings, and this value is neither. Send "stop" as a string or an array of strings.')


# ----------------------------------------------------------------------------------------------------
# Defaults sent explicitly
# ----------------------------------------------------------------------------------------------------

CHAT_DEFAULTS = {
    "model": "anything", "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
    "top_logprobs": 0, "n": 1, "stop": [], "stream": False, "temperature": 1, "top_p": 1, "tool_choice": "auto",
    "parallel_tool_calls": True, "stream_options": None, "modalities": ["text"], "audio": None,
    "prediction": None, "web_search_options": None, "functions": [], "function_call": None, "verbosity": None,
    "moderation": None, "tools": [], "response_format": {"type": "text"}, "user": "", "store": False,
    "metadata": {}, "service_tier": "auto", "seed": None, "max_tokens": None, "max_completion_tokens": None,
    "top_k": -1, "min_p": 0, "repetition_penalty": 1, "ignore_eos": False, "stop_token_ids": [],
}
COMPLETION_DEFAULTS = {
    "model": "anything", "best_of": 1, "echo": False, "suffix": "", "frequency_penalty": 0, "presence_penalty": 0,
    "logit_bias": {}, "logprobs": None, "top_logprobs": None, "n": 1, "stop": [], "stream": False,
    "stream_options": None, "temperature": 1.0, "top_p": 1.0, "user": "", "top_k": 0, "min_p": 0.0,
    "repetition_penalty": 1.0, "ignore_eos": False, "stop_token_ids": [],
}


@pytest.mark.parametrize("endpoint,name,value", [(CHAT, k, v) for k, v in CHAT_DEFAULTS.items()]
                         + [(COMPLETIONS, k, v) for k, v in COMPLETION_DEFAULTS.items()])
def test_each_documented_default_accepted(endpoint, name, value):
    spelled, bare = parse(endpoint, **{name: value}), parse(endpoint)
    if name in ("tool_choice", "response_format"):  # passed on as chat options; their defaults are checked there
        assert spelled.chat_options == {name: value} and bare.chat_options == {}
        bare = dataclasses.replace(bare, chat_options=spelled.chat_options)
    assert behaviour(spelled) == behaviour(bare)


@pytest.mark.parametrize("endpoint,defaults", [(CHAT, CHAT_DEFAULTS), (COMPLETIONS, COMPLETION_DEFAULTS)])
def test_all_defaults_at_once_behave_like_a_bare_request(endpoint, defaults):
    strict = SimpleNamespace(per_request_sampling=False, per_request_top_k=False, penalties=False,
                             logit_bias=False, logprobs=False, structured_outputs=False)
    full = parse(endpoint, strict, **defaults)
    assert full.n == 1 and not full.stream and not full.want_logprobs
    assert "max_tokens" not in full.sampling and "logprobs" not in full.sampling
    assert SamplingParams(**full.sampling, max_tokens=16) == SamplingParams(max_tokens=16)
    assert SamplingParams(**parse(endpoint).sampling, max_tokens=16) == SamplingParams(max_tokens=16)


# ----------------------------------------------------------------------------------------------------
# Unknown fields, body shape
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("name", ["frobnicate", "guided_json", "skip_special_tokens", "Temperature"])
def test_unknown_field_is_refused_by_name(endpoint, name):
    err = refused(endpoint, name, **{name: 1})
    assert f'"{name}"' in str(err)


def test_other_endpoints_field_is_unknown_with_a_hint():
    err = refused(COMPLETIONS, "max_completion_tokens", max_completion_tokens=5)
    assert "/v1/chat/completions" in str(err)
    for name in ("echo", "suffix", "best_of", "prompt"):
        assert "/v1/completions" in str(refused(CHAT, name, **{name: None}))
    for name in ("messages", "tools", "thinking_mode", "drop_thinking", "store", "metadata"):
        refused(COMPLETIONS, name, **{name: None})


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("body", [[], "x", None, 5, [("messages", MESSAGES)]])
def test_body_must_be_an_object(endpoint, body):
    refused(endpoint, None, body=body)


def test_required_fields():
    refused(CHAT, "messages", body={})
    refused(COMPLETIONS, "prompt", body={"max_tokens": 5})


# ----------------------------------------------------------------------------------------------------
# Implemented fields
# ----------------------------------------------------------------------------------------------------


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse(CHAT, max_tokens=5, max_completion_tokens=9).sampling["max_tokens"] == 9
    assert parse(CHAT, max_completion_tokens=9, max_tokens=5).sampling["max_tokens"] == 9
    assert parse(CHAT, max_tokens=5).sampling["max_tokens"] == 5
    assert parse(CHAT, max_tokens=5, max_completion_tokens=None).sampling["max_tokens"] == 5
    assert "max_tokens" not in parse(CHAT).sampling
    assert parse(COMPLETIONS, max_tokens=7).sampling["max_tokens"] == 7
    refused(CHAT, "max_tokens", max_tokens="x", max_completion_tokens=9)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_n_bounds(endpoint):
    assert parse(endpoint).n == 1
    assert parse(endpoint, n=1).n == 1
    assert parse(endpoint, n=MAX_N).n == MAX_N
    assert parse(endpoint, n=3.0).n == 3
    for bad in (0, -2, MAX_N + 1, 2.5, True, False, "2", [2]):
        refused(endpoint, "n", n=bad)


def test_prompt_shapes():
    assert parse(COMPLETIONS, prompt="hi").prompts == ["hi"]
    assert parse(COMPLETIONS, prompt=["a", "b", ""]).prompts == ["a", "b", ""]
    assert parse(COMPLETIONS, prompt=[1, 2, 3]).prompts == [[1, 2, 3]]
    assert parse(COMPLETIONS, prompt=[[1, 2], [3]]).prompts == [[1, 2], [3]]
    assert parse(COMPLETIONS, prompt=(4, 5)).prompts == [[4, 5]]


def test_chat_logprobs_spelling():
    p = parse(CHAT, logprobs=True)
    assert p.want_logprobs and p.sampling["logprobs"] == 0
    p = parse(CHAT, logprobs=True, top_logprobs=5)
    assert p.want_logprobs and p.sampling["logprobs"] == 5
    p = parse(CHAT, logprobs=False, top_logprobs=0)
    assert not p.want_logprobs and "logprobs" not in p.sampling
    assert parse(CHAT, logprobs=True, top_logprobs=20).sampling["logprobs"] == 20
    refused(CHAT, "top_logprobs", top_logprobs=2)
    refused(CHAT, "top_logprobs", logprobs=False, top_logprobs=2)
    refused(CHAT, "logprobs", logprobs=5)
    streamed = parse(CHAT, logprobs=True, top_logprobs=2, stream=True)
    assert streamed.stream and streamed.want_logprobs and streamed.sampling["logprobs"] == 2
    refused(CHAT, "top_logprobs", logprobs=True, top_logprobs=21)
    assert parse(CHAT, logprobs=False, stream=True).stream


def test_completion_logprobs_spelling():
    p = parse(COMPLETIONS, logprobs=0)
    assert p.want_logprobs and p.sampling["logprobs"] == 0
    assert parse(COMPLETIONS, logprobs=20).sampling["logprobs"] == 20
    assert not parse(COMPLETIONS, logprobs=None).want_logprobs
    refused(COMPLETIONS, "logprobs", logprobs=True)
    streamed = parse(COMPLETIONS, logprobs=3, stream=True)
    assert streamed.stream and streamed.want_logprobs and streamed.sampling["logprobs"] == 3
    refused(COMPLETIONS, "top_logprobs", logprobs=3, top_logprobs=3)


def test_stream_options():
    assert parse(CHAT, stream_options={"include_usage": True}).stream is False  # satisfied by a full response
    assert parse(COMPLETIONS, stream_options={"include_usage": True}).stream is False
    assert parse(CHAT, stream=True, stream_options={"include_usage": False, "include_obfuscation": False}).stream
    assert not parse(CHAT, stream_options={"include_usage": True}).include_usage      # no stream, no usage chunk
    for endpoint in (CHAT, COMPLETIONS):
        assert parse(endpoint, stream=True, stream_options={"include_usage": True}).include_usage
        assert not parse(endpoint, stream=True).include_usage
        refused(endpoint, "stream_options", stream=True, stream_options={"include_obfuscation": True})


def test_stop_normalised():
    assert parse(CHAT, stop="END").sampling["stop"] == ("END",)
    assert parse(CHAT, stop=["", "a", ""]).sampling["stop"] == ("a",)
    assert parse(COMPLETIONS, stop="").sampling["stop"] == ()


def test_sampling_values_reach_sampling_params():
    p = parse(CHAT, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=7, frequency_penalty=0.5,
              presence_penalty=-0.5, repetition_penalty=1.1, logit_bias={"42": 5, 7: -100}, ignore_eos=True,
              stop_token_ids=[2, 3], max_tokens=12)
    params = SamplingParams(**p.sampling)
    assert params.temperature == 0.7 and params.top_p == 0.9 and params.top_k == 40 and params.seed == 7
    assert params.logit_bias == {42: 5.0, 7: -100.0} and params.stop_token_ids == (2, 3) and params.ignore_eos
    assert params.max_tokens == 12 and params.repetition_penalty == 1.1 and params.presence_penalty == -0.5
    assert parse(CHAT, top_k=-1).sampling["top_k"] == 0
    assert parse(CHAT, temperature=0).sampling["temperature"] == 0.0
    assert parse(CHAT, temperature=2).sampling["temperature"] == 2.0


def test_chat_options_and_extensions():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": MESSAGES, "tools": tools, "tool_choice": "auto", "response_format": {"type": "text"},
            "reasoning_effort": "low", "thinking_mode": False, "add_generation_prompt": True,
            "chat_template_kwargs": {"enable_thinking": False}, "request_id": "req-1", "drop_thinking": True}
    p = parse_chat_request(body, None)
    assert p.chat_options == {"tools": tools, "tool_choice": "auto", "response_format": {"type": "text"},
                              "reasoning_effort": "low", "thinking_mode": False, "add_generation_prompt": True,
                              "chat_template_kwargs": {"enable_thinking": False}}
    assert p.request_id == "req-1" and p.drop_thinking is True
    assert p.messages == MESSAGES and p.messages is not MESSAGES and p.prompts is None
    assert parse(CHAT).chat_options == {} and parse(CHAT).drop_thinking is None
    assert parse(COMPLETIONS, request_id="c-1").request_id == "c-1"
    assert parse(CHAT, parallel_tool_calls=True).chat_options == {}


def test_caller_body_not_mutated():
    body = {"messages": [{"role": "user", "content": "x"}], "stop": ["", "a"], "logit_bias": {"1": 2},
            "tools": [{"type": "function", "function": {"name": "f"}}]}
    snapshot = repr(body)
    parse_chat_request(body, None)
    assert repr(body) == snapshot


# ----------------------------------------------------------------------------------------------------
# Capabilities
# ----------------------------------------------------------------------------------------------------


def caps(**overrides: Any) -> SimpleNamespace:
    base = dict(per_request_sampling=True, per_request_top_k=True, logprobs=True, max_logprobs=20,
                penalties=True, logit_bias=True, structured_outputs=False, details={})
    return SimpleNamespace(**{**base, **overrides})


def test_caps_logprobs():
    off = caps(logprobs=False)
    refused(CHAT, "logprobs", off, logprobs=True)
    refused(CHAT, "logprobs", off, logprobs=True, top_logprobs=3)
    refused(COMPLETIONS, "logprobs", off, logprobs=0)
    parse(CHAT, off, logprobs=False, top_logprobs=0)
    parse(COMPLETIONS, off, logprobs=None)
    five = caps(max_logprobs=5)
    assert parse(CHAT, five, logprobs=True, top_logprobs=5).sampling["logprobs"] == 5
    refused(CHAT, "top_logprobs", five, logprobs=True, top_logprobs=6)
    refused(COMPLETIONS, "logprobs", five, logprobs=6)


def test_caps_sampling_check():
    fixed = caps(per_request_sampling=False)
    for name, value in (("temperature", 0.7), ("top_p", 0.9), ("seed", 1), ("min_p", 0.1)):
        for endpoint in (CHAT, COMPLETIONS):
            refused(endpoint, name, fixed, **{name: value})
    parse(CHAT, fixed, temperature=1.0, top_p=1, min_p=0, seed=None)
    refused(CHAT, "n", fixed, n=2)  # the fixed distribution is stochastic: choices would not be independent
    greedy = caps(per_request_sampling=False, details={"sampling_defaults": {"temperature": 0.0}})
    assert parse(CHAT, greedy, temperature=0, n=3).n == 3
    refused(CHAT, "temperature", greedy, temperature=1.0)
    no_k = caps(per_request_top_k=False)
    parse(CHAT, no_k, top_k=0)
    parse(CHAT, no_k, top_k=-1)
    refused(COMPLETIONS, "top_k", no_k, top_k=5)
    parse(CHAT, fixed, top_k=5)  # top-k has its own capability


def test_caps_penalties_and_bias():
    off = caps(penalties=False, logit_bias=False)
    for name, value in (("frequency_penalty", 0.5), ("presence_penalty", -1), ("repetition_penalty", 1.2)):
        refused(CHAT, name, off, **{name: value})
        refused(COMPLETIONS, name, off, **{name: value})
    refused(CHAT, "logit_bias", off, logit_bias={"5": 1})
    parse(CHAT, off, frequency_penalty=0, presence_penalty=0, repetition_penalty=1, logit_bias={})
    absent = SimpleNamespace()  # attributes absent: penalties and bias are on, structured outputs off
    assert parse(CHAT, absent, frequency_penalty=1, logit_bias={"1": 1}).sampling["frequency_penalty"] == 1.0
    refused(CHAT, "response_format", absent, response_format={"type": "json_object"})


def test_caps_structured_outputs():
    on = caps(structured_outputs=True)
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert parse(CHAT, on, response_format=schema).chat_options["response_format"] == schema
    assert parse(CHAT, on, response_format={"type": "json_object"}).chat_options
    refused(CHAT, "response_format", caps(), response_format=schema)
    parse(CHAT, caps(), response_format={"type": "text"})
    # The native plane (backend='auto' runs Qwen3.5 there): the refusal says which backend has them.
    with pytest.raises(InvalidRequestError, match="backend='torch'") as err:
        parse_chat_request({"messages": MESSAGES, "response_format": schema}, caps(details={"backend": "cpp"}))
    assert err.value.param == "response_format"
    with pytest.raises(InvalidRequestError) as err:
        parse_chat_request({"messages": MESSAGES, "response_format": schema}, caps())
    assert "backend=" not in str(err.value)


def test_engine_caps_object_is_accepted():
    from pocketllm.backends.base import EngineCaps

    p = parse_chat_request({"messages": MESSAGES, "logprobs": True, "top_logprobs": 20}, EngineCaps(max_slots=4))
    assert p.sampling["logprobs"] == 20


# ----------------------------------------------------------------------------------------------------
# Layering
# ----------------------------------------------------------------------------------------------------


def test_module_imports_no_torch_or_server_stack():
    code = ("import sys; import pocketllm.protocol.openai_fields; "
            "bad = [m for m in ('torch', 'fastapi', 'pydantic', 'pocketllm.engine', 'pocketllm.runner', "
            "'pocketllm.backends') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompts_times_n_are_capped():
    assert parse(COMPLETIONS, prompt=["a"] * 32, n=MAX_CHOICES // 32).n == MAX_CHOICES // 32
    err = refused(COMPLETIONS, "prompt", prompt=["a"] * 32, n=MAX_CHOICES // 32 + 1)
    assert f"at most {MAX_CHOICES}" in str(err)
