"""The real app and engine on a tiny random checkpoint whose forward pass is scripted, for the server tests of
tool calls, reasoning and the Responses API.

Everything is real: the FastAPI app, ``OpenAIServing``, ``AsyncLLM``, the engine (scheduler, sampler with its
grammars, stop, EOS and budget handling, cancellation) and the output processor, on a tiny random checkpoint with
the in-repo fixture tokenizer and a chat template. Only the model's logits are replaced: the logits of each
sampling row put all the mass on the next token of a scripted answer (then EOS), so the engine writes that answer.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from typing import Any

import pytest


class Script:
    """The answer the engine will write (``script``), and the prompts it was given, decoded (``prompts``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.script = ""
        self.prompts: list[str] = []
        self._seen: set[str] = set()

    def force(self, chunks, logits):
        """Logits that make every sampling row's next token the script's next one (EOS after the script)."""
        import torch

        ids = self.tokenizer.encode(self.script, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        rows = [chunk for chunk in chunks if chunk.samples]
        forced = torch.full_like(logits, -1e4)
        for row, chunk in enumerate(rows):
            request = chunk.request
            if request.request_id not in self._seen:
                self._seen.add(request.request_id)
                self.prompts.append(self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False))
            produced = chunk.end - len(request.prompt_token_ids)  # output tokens before this one
            forced[row, ids[min(produced, len(ids) - 1)]] = 1e4
        return forced


def build_chat_checkpoint(tmp_path_factory: pytest.TempPathFactory, r1_tokenizer: Any, arch: str,
                          template: str | None, name: str) -> str:
    """A tiny random checkpoint of ``arch`` with the fixture tokenizer (and ``template`` if given)."""
    import torch
    from conftest import tiny_config
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp(name)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(r1_tokenizer.directory / file, directory / file)
    if template is not None:
        (directory / "chat_template.jinja").write_text(template, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    config = tiny_config(arch)
    config.vocab_size = len(tokenizer)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(directory))
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as handle:
        json.dump({"eos_token_id": tokenizer.eos_token_id}, handle)
    return str(directory)


def scripted_forward() -> Iterator[dict[str, Script]]:
    """For a module fixture: the model runner's forward pass with its logits scripted while the module runs;
    the dict it yields says whose script (``{model_type: Script}``)."""
    from pocketllm.runner.model_runner import ModelRunner

    by_model: dict[str, Script] = {}
    launch = ModelRunner.launch

    def scripted_launch(runner, chunks, previous_tokens=None):
        logits = launch(runner, chunks, previous_tokens)
        return None if logits is None else by_model[runner.hf_config.model_type].force(chunks, logits)

    patch = pytest.MonkeyPatch()
    patch.setattr(ModelRunner, "launch", scripted_launch)
    yield by_model
    patch.undo()


def serve_scripted(model_dir: str, scripts: dict[str, Script]) -> tuple[Any, Script]:
    """A running app over the real engine, its logits scripted: (TestClient, Script); exit the client after."""
    from fastapi.testclient import TestClient
    from transformers import AutoConfig

    from pocketllm.config import EngineArgs
    from pocketllm.server.app import ServerConfig, build_app
    from pocketllm.tokenizer.tokenizer import Tokenizer

    script = Script(Tokenizer.from_checkpoint_dir(model_dir))
    scripts[AutoConfig.from_pretrained(model_dir).model_type] = script
    args = EngineArgs(model=model_dir, max_model_len=1024, cpu_kv_cache_gb=0.05)
    client = TestClient(build_app(ServerConfig(args, served_model_name="tiny")))
    client.__enter__()
    deadline = time.monotonic() + 120
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline, "the app did not become ready"
        time.sleep(0.02)
    return client, script


def openai_client(client: Any) -> Any:
    """An ``openai.OpenAI`` that talks to the TestClient's app."""
    from openai import OpenAI

    return OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
