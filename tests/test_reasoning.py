"""Reasoning split: detection by template/tokenizer, streaming at any boundary, stop on the answer only,
request options mapped to what the template understands, and the library path on a tiny real engine."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pytest

from pocketllm.engine.output_processor import RequestStream
from pocketllm.engine.request import FinishReason, Request, RequestStatus
from pocketllm.errors import InvalidRequestError
from pocketllm.outputs import RequestOutput, TokenEvent
from pocketllm.protocol.chat_output import chat_output_spec, detect_chat_syntax
from pocketllm.protocol.chat_request import build_chat_prompt
from pocketllm.protocol.reasoning import (
    ANSWER,
    INSIDE,
    OPEN,
    ReasoningSplitter,
    ReasoningSyntax,
    detect_reasoning,
    initial_state,
    template_reasoning_effort,
)
from pocketllm.sampling_params import SamplingParams
from pocketllm.step.sampled import SampledToken

QWEN35_TEMPLATE = Path(__file__).resolve().parent / "fixtures" / "chat_templates" / "qwen3_5.jinja"


@pytest.fixture(scope="module")
def fixture_tokenizer(r1_tokenizer):
    from pocketllm.tokenizer.tokenizer import Tokenizer

    return Tokenizer.from_checkpoint_dir(str(r1_tokenizer.directory))


@pytest.fixture(scope="module")
def think_end_id(fixture_tokenizer) -> int:
    (token,) = fixture_tokenizer.encode("</think>", add_special_tokens=False)
    return token


@pytest.fixture(scope="module")
def qwen35_template() -> str:
    return QWEN35_TEMPLATE.read_text(encoding="utf-8")


def _split_all(text: str, state: str, pieces: list[str] | None = None) -> tuple[str, str]:
    splitter = ReasoningSplitter(ReasoningSyntax(), state)
    reasoning, answer = "", ""
    for piece in pieces if pieces is not None else [text]:
        r, a = splitter.push(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.flush()
    return reasoning + r, answer + a


# ----------------------------------------------------------------------------------------------------
# The splitter
# ----------------------------------------------------------------------------------------------------

SPLIT_CASES = [
    ("<think>\nWeigh it.\n\nTwice.\n</think>\n\nThe answer is 4.", OPEN, ("Weigh it.\n\nTwice.", "The answer is 4.")),
    ("\n<think>a</think>b", OPEN, ("a", "b")),
    ("  Hello <think>not reasoning</think>", OPEN, ("", "  Hello <think>not reasoning</think>")),
    ("<thin", OPEN, ("", "<thin")),
    ("", OPEN, ("", "")),
    ("Step one.\n</think>\n\nDone.", INSIDE, ("Step one.", "Done.")),
    ("\nStill thinking when the budget ran out\n", INSIDE, ("Still thinking when the budget ran out", "")),
    ("</think>Direct.", INSIDE, ("", "Direct.")),
    ("<think>x</think>y", ANSWER, ("", "<think>x</think>y")),
    ("<think>\n\n</think>\n\n", OPEN, ("", "")),
    ("<think>a</think>b</think>c", OPEN, ("a", "b</think>c")),
]


@pytest.mark.parametrize(("text", "state", "expected"), SPLIT_CASES)
def test_split(text, state, expected):
    assert _split_all(text, state) == expected


@pytest.mark.parametrize(("text", "state", "expected"), SPLIT_CASES)
def test_split_is_the_same_at_every_boundary(text, state, expected):
    for cut in range(len(text) + 1):
        assert _split_all(text, state, [text[:cut], text[cut:]]) == expected
    rng = random.Random(3)
    for _ in range(30):
        pieces, rest = [], text
        while rest:
            size = rng.randint(1, 4)
            pieces.append(rest[:size])
            rest = rest[size:]
        assert _split_all(text, state, pieces) == expected


def test_answer_start_offset():
    splitter = ReasoningSplitter(ReasoningSyntax(), OPEN)
    text = "<think>r</think>\n\nanswer"
    splitter.push(text)
    assert text[splitter.answer_start:] == "answer"
    plain = ReasoningSplitter(ReasoningSyntax(), OPEN)
    plain.push("  hi")
    assert plain.answer_start == 0 and not plain.saw_reasoning


# ----------------------------------------------------------------------------------------------------
# Decided by the checkpoint: template, tokenizer, architecture; where the output starts
# ----------------------------------------------------------------------------------------------------


def test_detection(fixture_tokenizer, qwen35_template):
    vocab = fixture_tokenizer.hf.get_vocab()
    has = vocab.__contains__
    assert detect_reasoning(qwen35_template, has) == ReasoningSyntax()
    assert detect_reasoning(fixture_tokenizer.chat_template, has) == ReasoningSyntax()  # R1 distill
    assert detect_reasoning(qwen35_template, lambda token: False) is None  # no <think> tokens
    assert detect_reasoning("{{ messages[0].content }}", has) is None
    assert detect_reasoning(None, has) is None
    assert detect_chat_syntax(None, "DeepseekV4ForCausalLM").reasoning == ReasoningSyntax()
    syntax = detect_chat_syntax(qwen35_template, "Qwen3ForCausalLM", has)
    assert syntax.reasoning is not None and syntax.tool_parser.name == "qwen_xml"
    r1 = detect_chat_syntax(fixture_tokenizer.chat_template, "Qwen2ForCausalLM", has)
    assert r1.reasoning is not None and r1.tool_parser is None


def test_smollm2_writes_no_reasoning(smollm2_gguf):
    from pocketllm.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(smollm2_gguf)
    syntax = detect_chat_syntax(tok.chat_template, "LlamaForCausalLM", tok.hf.get_vocab().__contains__)
    assert syntax.reasoning is None and syntax.tool_parser is None
    assert chat_output_spec(syntax, "prompt") is None


USER = [{"role": "user", "content": "2+2?"}]


def test_where_the_output_starts(fixture_tokenizer, qwen35_template):
    syntax = ReasoningSyntax()
    opened = build_chat_prompt(qwen35_template, USER, thinking_mode=True)
    closed = build_chat_prompt(qwen35_template, USER, thinking_mode=False)
    default = build_chat_prompt(qwen35_template, USER)
    r1 = build_chat_prompt(fixture_tokenizer.chat_template, USER,
                           special_tokens={"bos_token": fixture_tokenizer.bos_token})
    assert opened.endswith("<think>\n") and initial_state(syntax, opened) == INSIDE
    assert initial_state(syntax, closed) == ANSWER and initial_state(syntax, default) == ANSWER
    assert r1.endswith("<｜Assistant｜>") and initial_state(syntax, r1) == OPEN
    # A template that opens the block in its generation prompt (as newer R1 templates do).
    opening = "{% for m in messages %}{{ m.content }}{% endfor %}<｜Assistant｜><think>\n"
    assert initial_state(syntax, build_chat_prompt(opening, USER)) == INSIDE


# ----------------------------------------------------------------------------------------------------
# Request options mapped to the template's vocabulary
# ----------------------------------------------------------------------------------------------------

EFFORT_TEMPLATE = ("{%- if reasoning_effort is defined and reasoning_effort in ['low', 'medium', 'xhigh'] -%}"
                   "[effort={{ reasoning_effort }}]{%- endif -%}"
                   "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")


@pytest.mark.parametrize(("asked", "sent"), [("high", "xhigh"), ("max", "xhigh"), ("xhigh", "xhigh"),
                                             ("low", "low"), ("minimal", "low"), ("medium", "medium")])
def test_reasoning_effort_mapped_to_the_template_vocabulary(asked, sent):
    assert template_reasoning_effort(EFFORT_TEMPLATE, asked) == sent
    assert build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning_effort=asked).startswith(f"[effort={sent}]")


def test_reasoning_effort_refusals(qwen35_template):
    with pytest.raises(InvalidRequestError) as info:
        build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning_effort="none")
    assert info.value.param == "reasoning_effort" and "xhigh" in info.value.message
    with pytest.raises(InvalidRequestError, match="takes no reasoning effort"):
        build_chat_prompt(qwen35_template, USER, reasoning_effort="high")
    free_form = "{{ reasoning_effort }}|{% for m in messages %}{{ m.content }}{% endfor %}"
    assert build_chat_prompt(free_form, USER, reasoning_effort="max").startswith("max|")


def test_thinking_mode_maps_to_enable_thinking(qwen35_template):
    assert build_chat_prompt(qwen35_template, USER, thinking_mode=True).endswith("<think>\n")
    assert build_chat_prompt(qwen35_template, USER, thinking_mode=False).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(InvalidRequestError, match="no thinking switch"):
        build_chat_prompt("{% for m in messages %}{{ m.content }}{% endfor %}", USER, thinking_mode=True)


KEEPS_ALL = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
             "</think>{% endif %}{{ m.content }}\n{% endfor %}")
HISTORY = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "add them"},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>inline reasoning</think>\n6"},
    {"role": "user", "content": "4+4?"},
]


def test_drop_thinking(qwen35_template):
    import copy

    original = copy.deepcopy(HISTORY)
    kept = build_chat_prompt(KEEPS_ALL, HISTORY, drop_thinking=False)
    assert "add them" in kept and "inline reasoning" in kept
    dropped = build_chat_prompt(KEEPS_ALL, HISTORY, drop_thinking=True)
    assert "add them" not in dropped and "inline reasoning" not in dropped and "assistant:6" in dropped
    assert build_chat_prompt(KEEPS_ALL, HISTORY) == kept  # absent: the template decides
    assert HISTORY == original  # the caller's messages are untouched
    # qwen3_5 always leaves earlier reasoning out, so keeping it cannot be honoured.
    with pytest.raises(InvalidRequestError) as info:
        build_chat_prompt(qwen35_template, HISTORY, drop_thinking=False)
    assert info.value.param == "drop_thinking"
    assert "add them" not in build_chat_prompt(qwen35_template, HISTORY, drop_thinking=True)


# ----------------------------------------------------------------------------------------------------
# The output processor on token streams of the real fixture tokenizer
# ----------------------------------------------------------------------------------------------------


def _drive(tokenizer, text: str, spec, stop=(), finish=FinishReason.STOP, stream=True,
           extra_ids: list[int] | None = None):
    """Feed the tokens of ``text`` through a RequestStream as the engine would, then EOS or the budget."""
    ids = tokenizer.encode(text, add_special_tokens=False) + (extra_ids or [])
    params = SamplingParams(max_tokens=len(ids) + 1, stop=tuple(stop))
    eos = tokenizer.eos_token_id
    request = Request("r", [1, 2, 3], params, frozenset({eos}))
    got: list[object] = []
    sink = RequestStream("r", [1, 2, 3], params.stop, lambda t: tokenizer.decode(t, skip_special_tokens=True),
                         tokenizer.token_text, got.append, stream, chat=spec)
    for index, token in enumerate(ids):
        request.output_token_ids.append(token)
        last = index == len(ids) - 1 and finish is FinishReason.LENGTH
        if last:
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
        if sink.on_output(request, SampledToken(token)):
            request.status, request.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
            break
    if not request.is_finished:
        request.output_token_ids.append(eos)
        request.status, request.finish_reason, request.stop_reason = RequestStatus.FINISHED, finish, eos
        sink.on_output(request, SampledToken(eos))
    events = [e for e in got if isinstance(e, TokenEvent)]
    final = next(e for e in got if isinstance(e, RequestOutput))
    return events, final, ids


def _spec(tokenizer, template: str, prompt: str, tools=None):
    return chat_output_spec(detect_chat_syntax(template, None, tokenizer.hf.get_vocab().__contains__), prompt, tools)


R1_OUTPUT = "<think>\nThe user asks 2+2. END is not the answer.\n</think>\n\nIt is 4. END of answer."


def test_stream_deltas_add_up_to_the_final_output(fixture_tokenizer):
    spec = _spec(fixture_tokenizer, fixture_tokenizer.chat_template, "<｜User｜>2+2?<｜Assistant｜>")
    events, final, ids = _drive(fixture_tokenizer, R1_OUTPUT, spec)
    assert final.reasoning_content == "The user asks 2+2. END is not the answer."
    assert final.text == "It is 4. END of answer."
    assert "".join(e.reasoning_content for e in events) == final.reasoning_content
    assert "".join(e.text for e in events) == final.text
    assert final.finish_reason == "stop" and final.token_ids == ids and final.tool_calls is None
    # Reasoning is streamed as it comes, not at the end.
    first_answer = next(i for i, e in enumerate(events) if e.text)
    assert any(e.reasoning_content for e in events[:first_answer])


def test_stop_applies_to_the_answer_only(fixture_tokenizer):
    spec = _spec(fixture_tokenizer, fixture_tokenizer.chat_template, "<｜User｜>2+2?<｜Assistant｜>")
    events, final, ids = _drive(fixture_tokenizer, R1_OUTPUT, spec, stop=["END"])
    assert final.reasoning_content == "The user asks 2+2. END is not the answer."
    assert final.text == "It is 4. " and final.finish_reason == "stop" and final.stop_reason == "END"
    assert "".join(e.text for e in events) == "It is 4. "
    # Tokens up to the stop are kept, reasoning tokens included; the ones after it are cut.
    kept = fixture_tokenizer.decode(final.token_ids)
    assert kept.startswith("<think>") and "It is 4." in kept and "of answer" not in kept


def test_stop_inside_reasoning_when_the_prompt_opened_it(fixture_tokenizer, qwen35_template):
    prompt = build_chat_prompt(qwen35_template, USER, thinking_mode=True)
    spec = _spec(fixture_tokenizer, qwen35_template, prompt)
    assert spec.reasoning_state == INSIDE
    events, final, _ = _drive(fixture_tokenizer, "Count: 1, 2.\n</think>\n\nFour.", spec, stop=["2"])
    assert final.reasoning_content == "Count: 1, 2." and final.text == "Four."


def test_budget_inside_reasoning_leaves_no_answer(fixture_tokenizer, qwen35_template):
    prompt = build_chat_prompt(qwen35_template, USER, thinking_mode=True)
    spec = _spec(fixture_tokenizer, qwen35_template, prompt)
    _, final, _ = _drive(fixture_tokenizer, "Still going and going", spec, finish=FinishReason.LENGTH)
    assert final.reasoning_content == "Still going and going" and final.text == ""
    assert final.finish_reason == "length"


def test_no_reasoning_block_leaves_text_unchanged(fixture_tokenizer):
    spec = _spec(fixture_tokenizer, fixture_tokenizer.chat_template, "<｜User｜>hi<｜Assistant｜>")
    _, final, _ = _drive(fixture_tokenizer, "  Just an answer.", spec)
    assert final.text == "  Just an answer." and final.reasoning_content is None


def test_tool_calls_after_reasoning(fixture_tokenizer, qwen35_template):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    prompt = build_chat_prompt(qwen35_template, USER, thinking_mode=True, tools=tools)
    spec = _spec(fixture_tokenizer, qwen35_template, prompt, tools)
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n" \
           "</parameter>\n</function>\n</tool_call>"
    events, final, _ = _drive(fixture_tokenizer, f"Need weather.\n</think>\n\nChecking.\n\n{call}", spec)
    assert final.reasoning_content == "Need weather." and final.text == "Checking."
    assert final.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in final.tool_calls] == [("get_weather",
                                                                             {"city": "Paris", "days": 3})]
    assert "".join(e.text for e in events) == "Checking."
    assert events[-1].tool_calls == final.tool_calls and events[-1].finish_reason == "tool_calls"
    # Cut by the budget: no calls, the text stays in content, as generated.
    events, final, _ = _drive(fixture_tokenizer, f"Need weather.\n</think>\n\n{call}", spec,
                              finish=FinishReason.LENGTH)
    assert final.tool_calls is None and final.text == call and final.finish_reason == "length"
    assert "".join(e.text for e in events) == call


# ----------------------------------------------------------------------------------------------------
# The library on a tiny real engine: fixture tokenizer + qwen3_5 template
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def think_model(tmp_path_factory, qwen35_template, r1_tokenizer, fixture_tokenizer):
    """A tiny random Qwen2 checkpoint with the fixture tokenizer and the qwen3_5 chat template."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = str(tmp_path_factory.mktemp("tiny-think"))
    eos = fixture_tokenizer.eos_token_id
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(fixture_tokenizer.hf), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=fixture_tokenizer.bos_token_id, eos_token_id=eos)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(r1_tokenizer.directory / name, os.path.join(directory, name))
    Path(directory, "chat_template.jinja").write_text(qwen35_template, encoding="utf-8")
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"eos_token_id": eos}, handle)
    return directory


@pytest.fixture(scope="module")
def think_llm(think_model):
    from pocketllm import LLM, EngineArgs

    with LLM(EngineArgs(model=think_model, max_model_len=512)) as llm:
        yield llm


def test_library_chat_splits_reasoning(think_llm, fixture_tokenizer, think_end_id):
    greedy = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
    # Thinking on and </think> forbidden: the whole output is reasoning.
    out = think_llm.chat(USER, SamplingParams(**greedy, logit_bias={think_end_id: -100.0}), thinking_mode=True)[0]
    raw = fixture_tokenizer.decode(out.token_ids)
    assert out.reasoning_content == raw.strip() and out.text == "" and out.finish_reason == "length"
    # A stop string taken from inside that reasoning does not cut it.
    needle = next((w for w in raw.split() if len(w) >= 2), None)
    if needle is not None:
        again = think_llm.chat(USER, SamplingParams(**greedy, logit_bias={think_end_id: -100.0}, stop=[needle]),
                               thinking_mode=True)[0]
        assert again.reasoning_content == out.reasoning_content and again.finish_reason == "length"
    # </think> forced first: no reasoning, and what follows is the answer.
    forced = think_llm.chat(USER, SamplingParams(**greedy, logit_bias={think_end_id: 100.0}), thinking_mode=True)[0]
    assert forced.reasoning_content == "" and forced.text == "</think>" * 11
    # Thinking off: the template closed the block, so everything is the answer.
    plain = think_llm.chat(USER, SamplingParams(**greedy), thinking_mode=False)[0]
    assert plain.reasoning_content is None and plain.text == fixture_tokenizer.decode(plain.token_ids)


def test_library_chat_stream_splits_reasoning(think_llm, think_end_id):
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logit_bias={think_end_id: -100.0})
    events = list(think_llm.chat_stream(USER, params, thinking_mode=True))
    whole = think_llm.chat(USER, params, thinking_mode=True)[0]
    assert "".join(e.reasoning_content for e in events) == whole.reasoning_content
    assert "".join(e.text for e in events) == "" and events[-1].output.reasoning_content == whole.reasoning_content


def test_reasoning_option_is_another_spelling_of_reasoning_effort():
    assert build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning={"effort": "high"}).startswith("[effort=xhigh]")
    assert build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning={"effort": "low"}, reasoning_effort="low")
    for bad in ({"effort": "low", "summary": "auto"}, "low"):
        with pytest.raises(InvalidRequestError) as info:
            build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning=bad)
        assert info.value.param == "reasoning"
    with pytest.raises(InvalidRequestError, match="disagree"):
        build_chat_prompt(EFFORT_TEMPLATE, USER, reasoning={"effort": "low"}, reasoning_effort="medium")


def test_cli_prints_reasoning_to_stderr_and_calls_as_json(capsys):
    from pocketllm.cli.generate_commands import _stream_to_stdout
    from pocketllm.protocol.tool_parsers import ToolCall

    call = ToolCall("get_weather", '{"city": "Paris"}', id="call_1")
    events = [TokenEvent("r", "", [1], reasoning_content="Thinking"), TokenEvent("r", "", [2], reasoning_content="."),
              TokenEvent("r", "Checking.", [3]),
              TokenEvent("r", "", [], finished=True, finish_reason="tool_calls", tool_calls=[call])]
    text, _, reason = _stream_to_stdout(events)
    out, err = capsys.readouterr()
    assert text == "Checking." and reason == "tool_calls" and err == "Thinking.\n"
    assert out == 'Checking.\n{"id": "call_1", "type": "function", "function": {"name": "get_weather", ' \
                  '"arguments": "{\\"city\\": \\"Paris\\"}"}}\n'
