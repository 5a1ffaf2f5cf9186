"""Tool-call parsers on crafted and template-rendered outputs: typed values, all-or-nothing, streaming, selection."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from pocketllm.protocol.chat_template import render_chat_template
from pocketllm.protocol.tool_parsers import (
    DsmlToolParser,
    HermesToolParser,
    QwenXmlToolParser,
    ToolCall,
    ToolCallStream,
    select_tool_parser,
    template_call_syntax,
    typed_value,
)
from pocketllm.protocol.tool_parsers.dsml import render_dsml_calls

TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"
QWEN35_TEMPLATE = TEMPLATES / "qwen3_5.jinja"
R1_TEMPLATE = TEMPLATES / "r1_distill.jinja"

SCHEMA_TOOL = {"type": "function", "function": {"name": "book", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "budget": {"type": "number"},
    "refundable": {"type": "boolean"},
    "options": {"type": "object"},
    "guests": {"type": "array", "items": {"type": "string"}},
    "note": {"type": ["string", "null"]},
    "room": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "level": {"enum": [1, 2, 3]},
    "weird": {"type": "decimal"},
}}}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


def _read(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _xml(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def _args(call: ToolCall) -> dict:
    return json.loads(call.arguments)


# ----------------------------------------------------------------------------------------------------
# Typed values
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "schema", "expected"), [
    ("3", {"type": "integer"}, 3),
    ("3.0", {"type": "integer"}, 3),
    ("3.5", {"type": "integer"}, "3.5"),
    ("01234", {"type": "integer"}, "01234"),
    ("three", {"type": "integer"}, "three"),
    ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7),
    ("NaN", {"type": "number"}, "NaN"),
    ("true", {"type": "boolean"}, True),
    ("false", {"type": "boolean"}, False),
    ("yes", {"type": "boolean"}, "yes"),
    ('{"a": [1, 2]}', {"type": "object"}, {"a": [1, 2]}),
    ("[1, 2]", {"type": "object"}, "[1, 2]"),
    ('["x", "y"]', {"type": "array"}, ["x", "y"]),
    ("3", {"type": "string"}, "3"),
    ("null", {"type": ["string", "null"]}, None),
    ("12", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 12),
    ("twelve", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "twelve"),
    ("2", {"enum": [1, 2, 3]}, 2),
    ("3", {"type": "decimal"}, "3"),
    ("3", None, "3"),
    ("3", {}, "3"),
])
def test_typed_value(text, schema, expected):
    value = typed_value(text, schema)
    assert value == expected and type(value) is type(expected)


# ----------------------------------------------------------------------------------------------------
# Qwen XML
# ----------------------------------------------------------------------------------------------------


def test_xml_values_typed_by_the_request_schema():
    text = _xml("book", city="Paris", days="3", budget="99.5", refundable="true", options='{"view": "sea"}',
                guests='["Ann", "Bob"]', note="null", room="12", level="2", weird="4", extra="5")
    parsed = QwenXmlToolParser().parse(text, [SCHEMA_TOOL])
    assert parsed is not None and parsed.content is None
    (call,) = parsed.calls
    assert call.name == "book"
    assert _args(call) == {"city": "Paris", "days": 3, "budget": 99.5, "refundable": True,
                           "options": {"view": "sea"}, "guests": ["Ann", "Bob"], "note": None, "room": 12,
                           "level": 2, "weird": "4", "extra": "5"}


def test_xml_without_tools_leaves_every_argument_a_string():
    parsed = QwenXmlToolParser().parse(_xml("book", days="3", refundable="true"), None)
    assert _args(parsed.calls[0]) == {"days": "3", "refundable": "true"}


def test_xml_multiline_values_and_several_calls_with_prose_before():
    text = ("Let me check both.\n\n" + _xml("get_weather", city="New York\nNY", days="2") + "\n"
            + _xml("get_weather", city="Paris"))
    parsed = QwenXmlToolParser().parse(text, [WEATHER_TOOL])
    assert parsed.content == "Let me check both."
    assert [c.name for c in parsed.calls] == ["get_weather", "get_weather"]
    assert [_args(c) for c in parsed.calls] == [{"city": "New York\nNY", "days": 2}, {"city": "Paris"}]
    assert len({c.id for c in parsed.calls}) == 2 and all(c.id.startswith("call_") for c in parsed.calls)


def test_xml_call_without_parameters():
    parsed = QwenXmlToolParser().parse("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    assert parsed.calls[0].name == "get_time" and parsed.calls[0].arguments == "{}"


WHOLE = _xml("get_weather", city="Paris", days="3")


@pytest.mark.parametrize("text", [
    WHOLE[:-len("</tool_call>")],  # truncated at the budget
    WHOLE[:-3],
    WHOLE[: WHOLE.index("</parameter>")],
    WHOLE.replace("</parameter>", "", 1),  # malformed: an unclosed parameter
    WHOLE.replace("<function=get_weather>", "<function=>"),
    WHOLE.replace("</function>", "</functon>"),
    WHOLE + "\nHope that helps!",  # prose after the call
    WHOLE + "\nand then\n" + WHOLE,  # prose between calls
    _xml("get_weather", city="Paris").replace("</function>", "<parameter=city>\nRome\n</parameter>\n</function>"),
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call",
    "No calls here at all.",
])
def test_xml_all_or_nothing(text):
    assert QwenXmlToolParser().parse(text, [WEATHER_TOOL]) is None


def test_xml_template_rendered_calls_parse_back():
    """The calls the qwen3_5 template writes for an assistant turn are read back as the same calls."""
    template = _read(QWEN35_TEMPLATE)
    calls = [{"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}},
             {"id": "call_2", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": "Rome"})}}]
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": calls}]
    rendered = render_chat_template(template, messages, add_generation_prompt=False, tools=[WEATHER_TOOL])
    turn = rendered.rsplit("<|im_start|>assistant\n", 1)[1].removesuffix("<|im_end|>\n")
    answer = turn.split("</think>", 1)[1].lstrip()
    parsed = QwenXmlToolParser().parse(answer, [WEATHER_TOOL])
    assert parsed.content == "Checking."
    assert [(c.name, _args(c)) for c in parsed.calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                          ("get_weather", {"city": "Rome"})]


# ----------------------------------------------------------------------------------------------------
# Hermes JSON
# ----------------------------------------------------------------------------------------------------


def _hermes(name: str, arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_calls():
    text = "Sure.\n" + _hermes("get_weather", {"city": "Paris", "days": 3}) + "\n" + _hermes("get_time", {})
    parsed = HermesToolParser().parse(text, [WEATHER_TOOL])
    assert parsed.content == "Sure."
    assert [(c.name, _args(c)) for c in parsed.calls] == [("get_weather", {"city": "Paris", "days": 3}),
                                                          ("get_time", {})]


def test_hermes_arguments_given_as_json_text():
    parsed = HermesToolParser().parse(_hermes("get_weather", json.dumps({"city": "Oslo"})))
    assert _args(parsed.calls[0]) == {"city": "Oslo"}


@pytest.mark.parametrize("text", [
    _hermes("f", {"a": 1})[:-5],
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": [1]}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {}, \"extra\": 1}\n</tool_call>",
    "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": NaN}}\n</tool_call>",
    _hermes("f", {}) + " then " + _hermes("g", {}),
    _hermes("f", {}) + " done",
])
def test_hermes_all_or_nothing(text):
    assert HermesToolParser().parse(text) is None


# ----------------------------------------------------------------------------------------------------
# DeepSeek-V4 DSML
# ----------------------------------------------------------------------------------------------------

D = "｜DSML｜"
SPEC_BLOCK = (f"\n\n<{D}tool_calls>\n<{D}invoke name=\"get_weather\">\n"
              f"<{D}parameter name=\"city\" string=\"true\">Paris</{D}parameter>\n"
              f"<{D}parameter name=\"days\" string=\"false\">3</{D}parameter>\n"
              f"</{D}invoke>\n</{D}tool_calls>")


def test_dsml_spec_example():
    parsed = DsmlToolParser().parse("I'll look it up." + SPEC_BLOCK)
    assert parsed.content == "I'll look it up."
    (call,) = parsed.calls
    assert call.name == "get_weather" and _args(call) == {"city": "Paris", "days": 3}


def test_dsml_json_values_inserted_unchanged_and_several_invokes():
    block = (f"<{D}tool_calls>\n<{D}invoke name=\"pay\">\n"
             f"<{D}parameter name=\"amount\" string=\"false\">1.50</{D}parameter>\n"
             f"<{D}parameter name=\"meta\" string=\"false\">{{\"tags\": [\"a\"]}}</{D}parameter>\n"
             f"<{D}parameter name=\"memo\" string=\"true\">say \"hi\"\nthen</{D}parameter>\n"
             f"</{D}invoke>\n<{D}invoke name=\"noop\">\n</{D}invoke>\n</{D}tool_calls>")
    parsed = DsmlToolParser().parse(block)
    assert parsed.content is None
    pay, noop = parsed.calls
    assert pay.arguments == '{"amount": 1.50, "meta": {"tags": ["a"]}, "memo": "say \\"hi\\"\\nthen"}'
    assert _args(pay) == {"amount": 1.5, "meta": {"tags": ["a"]}, "memo": 'say "hi"\nthen'}
    assert noop.name == "noop" and noop.arguments == "{}"


@pytest.mark.parametrize("text", [
    SPEC_BLOCK[:-5],  # truncated
    SPEC_BLOCK.replace(f"<{D}parameter name=\"days\"", f"<{D}parameter name=\"city\""),  # duplicate parameter
    SPEC_BLOCK.replace("\"get_weather\">\n", "\"get_weather\">"),  # missing >\n after a tag
    SPEC_BLOCK.replace(f"<{D}tool_calls>\n", f"<{D}tool_calls>"),
    SPEC_BLOCK + "\nDone.",  # text after the block
    SPEC_BLOCK.replace(">3<", ">three<"),  # string="false" that is not JSON
    SPEC_BLOCK.replace(">Paris<", "><｜User｜>Paris<"),  # a special string inside a value
    "<think>leaked</think>" + SPEC_BLOCK,  # a special string inside the content
    SPEC_BLOCK.replace("string=\"true\"", "string=\"yes\""),
])
def test_dsml_all_or_nothing(text):
    assert DsmlToolParser().parse(text) is None


def test_dsml_render_then_parse_round_trip():
    calls = [{"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": json.dumps({"city": "Paris", "days": 3})}},
             {"function": {"name": "log", "arguments": {"ok": True, "items": [1, "x"], "text": "a\nb"}}}]
    block = render_dsml_calls(calls)
    assert block.startswith(f"<{D}tool_calls>\n") and block.endswith(f"</{D}tool_calls>")
    parsed = DsmlToolParser().parse("\n\n" + block)
    assert [(c.name, _args(c)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("log", {"ok": True, "items": [1, "x"], "text": "a\nb"})]


# ----------------------------------------------------------------------------------------------------
# Streaming hold-back
# ----------------------------------------------------------------------------------------------------


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


STREAM_CASES = [
    (QwenXmlToolParser(), "Let me check.\n\n" + WHOLE, True),
    (QwenXmlToolParser(), WHOLE, True),
    (QwenXmlToolParser(), "Plain answer with a < sign and <tool_ mention.", False),
    (QwenXmlToolParser(), "Text\n\n" + WHOLE + "\nmore prose", False),
    (QwenXmlToolParser(), "Cut " + WHOLE[:40], False),
    (HermesToolParser(), "x " + _hermes("f", {"a": 1}), True),
    (DsmlToolParser(), "Looking." + SPEC_BLOCK, True),
    (DsmlToolParser(), "Looking." + SPEC_BLOCK[:-4], False),
]


@pytest.mark.parametrize(("parser", "text", "parses"), STREAM_CASES)
def test_stream_matches_one_shot_parse(parser, text, parses):
    whole = parser.parse(text, [WEATHER_TOOL])
    assert (whole is not None) == parses
    rng = random.Random(7)
    for _ in range(25):
        stream = ToolCallStream(parser, [WEATHER_TOOL])
        shown = "".join(stream.push(piece) for piece in _chunks(text, rng))
        tail, parsed = stream.finish()
        if parses:
            assert parsed is not None and tail == ""
            assert shown == (whole.content or "")
            assert [(c.name, c.arguments) for c in parsed.calls] == [(c.name, c.arguments) for c in whole.calls]
        else:
            assert parsed is None and shown + tail == text


def test_stream_holds_nothing_when_no_marker_can_start():
    stream = ToolCallStream(QwenXmlToolParser())
    assert stream.push("Hello there") == "Hello there"
    assert stream.push(" and <") == " and"  # the space before a possible marker is held with it
    assert stream.push("b>bold</b>") == " <b>bold</b>"


def test_stream_not_parsed_when_told_so():
    stream = ToolCallStream(QwenXmlToolParser())
    assert stream.push(WHOLE) == ""
    assert stream.finish(parse=False) == (WHOLE, None)


# ----------------------------------------------------------------------------------------------------
# Selection by the checkpoint's template / architecture, and the OpenAI shape
# ----------------------------------------------------------------------------------------------------

# A small template in the Hermes style of Qwen2.5/Qwen3 (our own, for the selector).
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Return <tool_call>{"name": <function-name>, "arguments": <args-json-object>}</tool_call><|im_end|>
{% endif %}{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content or '' }}{%- if message.tool_calls %}{% for tool_call in message.tool_calls %}
<tool_call>
{"name": "{{ tool_call.function.name }}", "arguments": {{ tool_call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_selection_follows_the_template():
    assert template_call_syntax(_read(QWEN35_TEMPLATE)) == "qwen_xml"
    assert isinstance(select_tool_parser(_read(QWEN35_TEMPLATE)), QwenXmlToolParser)
    assert isinstance(select_tool_parser(HERMES_TEMPLATE), HermesToolParser)
    # The R1 distill template writes DeepSeek-V3 style tool-call tokens, a syntax this server has not read.
    assert select_tool_parser(_read(R1_TEMPLATE)) is None
    assert select_tool_parser("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_selection_for_templates_without_a_template():
    assert isinstance(select_tool_parser(None, "DeepseekV4ForCausalLM"), DsmlToolParser)
    assert select_tool_parser(None, "Qwen3ForCausalLM") is None
    assert select_tool_parser(None, None) is None


def test_smollm2_template_has_no_call_syntax(smollm2_gguf):
    from pocketllm.tokenizer.tokenizer import Tokenizer

    assert select_tool_parser(Tokenizer.from_gguf(smollm2_gguf).chat_template) is None


def test_openai_shape():
    from openai.types.chat import ChatCompletionMessageToolCall

    call = QwenXmlToolParser().parse(WHOLE, [WEATHER_TOOL]).calls[0]
    shaped = call.to_openai()
    assert shaped["type"] == "function" and isinstance(shaped["function"]["arguments"], str)
    model = ChatCompletionMessageToolCall.model_validate(shaped)
    assert model.function.name == "get_weather" and json.loads(model.function.arguments) == {"city": "Paris",
                                                                                                "days": 3}
