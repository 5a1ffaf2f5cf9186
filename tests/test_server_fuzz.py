"""A bounded HTTP fuzzer over the endpoints of the real app and engine (a tiny random checkpoint): no
generated body gets a 5xx, every error is in the OpenAI shape, and a stream carries no error event.

``POCKETLLM_FUZZ_CASES`` sets the number of cases (default 2,000; ``make soak`` runs 20,000)."""

from __future__ import annotations

import json
import os
import random
import time

import pytest
from http_fuzz import fuzz_cases

from pocketllm.protocol.openai_fields import RESPONSES

CASES = int(os.environ.get("POCKETLLM_FUZZ_CASES", "2000"))


@pytest.fixture(scope="module")
def client(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app

    args = EngineArgs(model=tiny_checkpoint("llama"), max_model_len=256, cpu_kv_cache_gb=0.05)
    client = TestClient(build_app(ServerConfig(args, served_model_name="tiny")), raise_server_exceptions=False)
    client.__enter__()
    deadline = time.monotonic() + 120
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.02)
    yield client
    client.__exit__(None, None, None)


def _responses_problem(response) -> str | None:
    """What is wrong with one /v1/responses answer, or None: a stream must end with the whole response and
    carry no error event; a whole response has a status and output."""
    if response.status_code >= 400 or not response.headers.get("content-type", "").startswith("text/event-stream"):
        if response.status_code == 200 and response.json().get("status") not in ("completed", "incomplete"):
            return f"a 200 without a finished response: {response.text[:300]}"
        return _problem(response, chat_shaped=False)
    events = [json.loads(line[len("data: "):]) for line in response.text.split("\n") if line.startswith("data: ")]
    if not events or events[-1]["type"] not in ("response.completed", "response.incomplete"):
        return f"a stream without its last response event: {response.text[-300:]}"
    if [e["sequence_number"] for e in events] != list(range(len(events))):
        return "sequence numbers out of order"
    if any(e["type"] == "error" for e in events):
        return f"an error event in a stream: {response.text[-300:]}"
    return None


def _problem(response, chat_shaped: bool = True) -> str | None:
    """What is wrong with one answer, or None."""
    if response.status_code >= 500:
        return f"{response.status_code}: {response.text[:300]}"
    if response.status_code >= 400:
        try:
            error = response.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} not in the OpenAI shape: {response.text[:300]}"
        if set(error) != {"message", "type", "param", "code"} or not error["message"]:
            return f"{response.status_code} not in the OpenAI shape: {error}"
        return None
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        lines = [line for line in response.text.split("\n") if line.startswith("data: ")]
        if not lines or lines[-1] != "data: [DONE]":
            return f"a stream without [DONE]: {response.text[-300:]}"
        for line in lines[:-1]:
            if "error" in json.loads(line[len("data: "):]):
                return f"an error event in a stream: {line[:300]}"
    elif chat_shaped:
        body = response.json()
        if not body.get("choices"):
            return f"a 200 without choices: {response.text[:300]}"
    return None


def test_no_generated_body_gets_a_5xx_or_a_bare_error(client):
    statuses: dict[int, int] = {}
    problems: list[str] = []
    for path, body in fuzz_cases(CASES, random.Random(31)):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = _problem(response)
        if problem is not None:
            problems.append(f"{path} {body[:200]!r}: {problem}")
    assert not problems, f"{len(problems)} of {CASES} cases: " + "\n".join(problems[:10])
    assert statuses.get(200, 0) > CASES // 20 and statuses.get(400, 0) > CASES // 2, statuses   # both kinds ran
    assert client.get("/health").json()["status"] == "ok"


def test_no_generated_responses_body_gets_a_5xx_or_a_bare_error(client):
    statuses: dict[int, int] = {}
    problems: list[str] = []
    count = max(CASES // 4, 200)
    for path, body in fuzz_cases(count, random.Random(37), endpoints=(RESPONSES,)):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        problem = _responses_problem(response)
        if problem is not None:
            problems.append(f"{path} {body[:200]!r}: {problem}")
    assert not problems, f"{len(problems)} of {count} cases: " + "\n".join(problems[:10])
    assert statuses.get(200, 0) > count // 20 and statuses.get(400, 0) > count // 2, statuses   # both kinds ran
