"""A chat request with tools to a tiny DeepSeek-V4 checkpoint, served by the real app and engine, comes back as
``message.tool_calls`` read from the DSML the model wrote (streamed or not; a Responses request with the same
conversation as a ``function_call`` item).

Nothing on the serving path is replaced: the checkpoint ships no chat template, so the server renders the
conversation with our DeepSeek-V4 encoder, the DeepSeek-V4 model computes every step (prefill, then one decode
step a token), the sampler picks greedily, and the DSML tool parser turns the decoded answer into the calls.

How a random model comes to write DSML: only its LM head is chosen. Every other weight is drawn at random, as
for the other tiny checkpoints. transformers' DeepSeek-V4 (the reference) is run once, teacher-forced, over the
encoded prompt followed by the DSML answer; the final hidden states before each answer token (and before the
EOS after it) are linearly independent (121 steps, hidden size 256), so an LM head exists that gives each step's
next token the logit ``MARGIN`` and every other token 0 — the least-norm solution of that linear system. The
head holds nothing but that answer; the server writes it only if it encodes the very prompt the head was fitted
to (our encoder, the same tokenizer) and its model computes transformers' hidden states at every step (a logit
error above ``MARGIN`` / 2 would change a token). A forced ``tool_choice`` would not test this: it constrains the
answer to a JSON list by grammar and never reaches the DSML parser.
"""

from __future__ import annotations

import copy
import json
import os
import time

import pytest
import torch
from conftest import TINY_EOS_ID, randomize_constant_initialisations, tiny_config

ARCH = "deepseek_v4"
HIDDEN = 256
MARGIN = 30.0
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the weather in Paris for 3 days?"}]
ARGUMENTS = {"city": "Paris", "days": 3}


def _fit_lm_head(model, prompt: list[int], answer: list[int]) -> None:
    """Set ``model``'s LM head so that greedy decoding after ``prompt`` writes ``answer`` (it ends in EOS)."""
    ids = torch.tensor([prompt + answer[:-1]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:].double()   # [steps, D]
        tokens = sorted(set(answer))
        targets = torch.zeros(len(answer), len(tokens), dtype=torch.float64)
        targets[torch.arange(len(answer)), torch.tensor([tokens.index(t) for t in answer])] = MARGIN
        rows = torch.linalg.lstsq(hidden, targets, driver="gelsd").solution.T                  # [tokens, D]
        head = model.lm_head.weight
        head.zero_()
        head[torch.tensor(tokens)] = rows.to(head.dtype)
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:]
    assert logits.argmax(-1).tolist() == answer
    chosen = logits.gather(1, torch.tensor(answer)[:, None])
    runner_up = logits.scatter(1, torch.tensor(answer)[:, None], float("-inf")).max(-1).values
    assert float((chosen[:, 0] - runner_up).min()) > MARGIN - 1e-3, "the fitted head keeps the whole margin"


@pytest.fixture(scope="module")
def dsml_checkpoint(tmp_path_factory, smollm2_hf_tokenizer) -> str:
    """A tiny random DeepSeek-V4 checkpoint (no chat template) whose LM head writes the DSML call."""
    from transformers import AutoModelForCausalLM

    from pocketllm.protocol.deepseek_v4 import encode_messages
    from pocketllm.protocol.tool_parsers.dsml import render_dsml_calls
    from pocketllm.tokenizer.tokenizer import Tokenizer

    directory = str(tmp_path_factory.mktemp("tiny-deepseek-v4-dsml"))
    hf_tokenizer = copy.copy(smollm2_hf_tokenizer)
    hf_tokenizer.chat_template = None
    hf_tokenizer.save_pretrained(directory)
    tokenizer = Tokenizer.from_checkpoint_dir(directory)
    prompt = tokenizer.encode(encode_messages(MESSAGES, tools=[WEATHER]), add_special_tokens=False)
    answer = tokenizer.encode(render_dsml_calls([{"name": "get_weather", "arguments": ARGUMENTS}]),
                              add_special_tokens=False) + [TINY_EOS_ID]
    config = tiny_config(ARCH)
    config.hidden_size = HIDDEN
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_constant_initialisations(model)
    assert len(answer) < HIDDEN
    _fit_lm_head(model, prompt, answer)
    model.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"eos_token_id": TINY_EOS_ID}, handle)
    return directory


@pytest.fixture(scope="module")
def client(dsml_checkpoint):
    """The app over the real engine on the checkpoint, in process."""
    from fastapi.testclient import TestClient

    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app

    args = EngineArgs(model=dsml_checkpoint, device="cpu", max_model_len=1024, num_kv_blocks=128)
    with TestClient(build_app(ServerConfig(args, served_model_name="tiny"))) as test_client:
        deadline = time.monotonic() + 120
        while test_client.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, "the app did not become ready"
            time.sleep(0.02)
        yield test_client


def _body(**extra) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "tools": [WEATHER], "temperature": 0, "max_tokens": 200, **extra}


def test_chat_with_tools_returns_the_dsml_call_as_tool_calls(client, dsml_checkpoint):
    """The non-streamed answer: one call, its arguments parsed from DSML (a string and a JSON value)."""
    from openai.types.chat import ChatCompletion

    from pocketllm.protocol.deepseek_v4 import encode_messages
    from pocketllm.tokenizer.tokenizer import Tokenizer

    response = client.post("/v1/chat/completions", json=_body())
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == ARGUMENTS
    assert ChatCompletion.model_validate(body).choices[0].message.tool_calls[0].function.name == "get_weather"
    prompt = Tokenizer.from_checkpoint_dir(dsml_checkpoint).encode(encode_messages(MESSAGES, tools=[WEATHER]),
                                                                   add_special_tokens=False)
    assert body["usage"]["prompt_tokens"] == len(prompt)


def test_streamed_chat_with_tools_streams_the_same_call(client):
    """The streamed answer: the call's deltas join to the same name and arguments; no content is streamed."""
    name, arguments, content, finish = "", "", "", None
    with client.stream("POST", "/v1/chat/completions", json=_body(stream=True)) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                assert call["index"] == 0
                name += call.get("function", {}).get("name") or ""
                arguments += call.get("function", {}).get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert (name, json.loads(arguments), content, finish) == ("get_weather", ARGUMENTS, "", "tool_calls")



def test_responses_request_with_tools_returns_the_dsml_call_as_a_function_call_item(client):
    """The Responses API runs on the same chat path: the instructions and input become the same conversation,
    the flat function tool the same tool, so the model writes the same DSML, returned as a function_call item."""
    function = WEATHER["function"]
    response = client.post("/v1/responses", json={
        "model": "tiny", "instructions": MESSAGES[0]["content"], "input": MESSAGES[1]["content"],
        "tools": [{"type": "function", **function}], "temperature": 0, "max_output_tokens": 200})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed"
    (call,) = body["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == ARGUMENTS
