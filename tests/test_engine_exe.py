"""``pocketllm_engine``, the native executable that serves the harness protocol without Python: its tokenizer
against the ``tokenizers`` library and transformers, and the protocol tests of ``pocketllm pipe``
(tests/test_harness_pipe.py) run against it with the default model, SmolLM2-135M-Instruct's Q4_1 GGUF, as the
pipe is tested (the executable keeps its Q4_1 layers in 4 bits where the CPU has AVX-512 VNNI, else float32).

The ``test_engine_*`` tests assert the same protocol behaviour with a tiny random Qwen3 safetensors checkpoint,
without the model's words."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess

import pytest
import test_harness_pipe as pipe_tests
from conftest import ENGINE_SKIP
from harness_utils import (
    FRANCE,
    PipeProcess,
    check_chat_usage_and_diag,
    check_four_conversations_interleave,
    check_fuzz_lines_answered,
    check_sampling_fields,
    check_sessions,
    checkpoint_without_template,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PIPE_TESTS = [name for name in dir(pipe_tests) if name.startswith("test_")]


def _copy(test):
    """The test under its own function object (a mark added here stays off the pipe's module)."""
    @functools.wraps(test)
    def run(*args, **kwargs):
        return test(*args, **kwargs)
    return run


for _name in _PIPE_TESTS:   # the pipe's own tests, collected again here with this module's fixtures
    globals()[_name] = _copy(getattr(pipe_tests, _name))


@pytest.fixture(scope="session")
def engine_exe() -> str:
    """The built executable (``make native`` builds it; POCKETLLM_ENGINE names another)."""
    path = os.environ.get("POCKETLLM_ENGINE") or os.path.join(ROOT, "cpp_engine", "build-python", "pocketllm_engine")
    if not os.access(path, os.X_OK):
        if os.environ.get("POCKETLLM_REQUIRE_NATIVE") == "1":
            pytest.fail(f"POCKETLLM_REQUIRE_NATIVE=1 but {path} is not built")
        pytest.skip(f"{ENGINE_SKIP} (make native)")
    return path


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint) -> str:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def pipe_process(engine_exe, smollm2_gguf):
    """The executable with the default model's GGUF (a ``--model`` argument replaces it)."""
    def start(*args: str) -> PipeProcess:
        model = [] if "--model" in args else ["--model", smollm2_gguf]
        return PipeProcess(*model, *args, command=[engine_exe])
    return start


@pytest.fixture(scope="module")
def no_template_model(tmp_path_factory, qwen3):
    return checkpoint_without_template(qwen3, str(tmp_path_factory.mktemp("no-template-qwen3")))


def _running(proc: PipeProcess):
    """``proc`` once ready, its first health answer kept; stopped (and checked for stray stdout) afterwards."""
    proc.send({"op": "health", "id": "first"})
    proc.first_health = proc.router.first("first", timeout=60)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()
        assert not proc.impure, f"stdout carried non-protocol lines: {proc.impure[:3]}"


@pytest.fixture(scope="module")
def pipe(pipe_process):
    """The default model on the executable, for the pipe's own tests."""
    yield from _running(pipe_process("--ctx", "2048", "--max-seqs", "6"))


@pytest.fixture(scope="module")
def qwen3_pipe(pipe_process, qwen3):
    """The tiny Qwen3 safetensors checkpoint on the executable, for the ``test_engine_*`` tests."""
    yield from _running(pipe_process("--model", qwen3, "--ctx", "2048", "--max-seqs", "6"))


TEXTS = [
    "Hello, world!", "The quick brown fox jumps over the lazy dog.", "  leading and   multiple   spaces  ",
    "tabs\tand\nnewlines\r\n\n\nend", "I'm you're we've they'll she'd IT'S DON'T 'x", "12345 67.89 1,000,000 3.14159",
    "naïve café résumé Ünïcödé", "日本語のテキスト、中文文本。", "Привет мир", "emoji 😀🎉👍🏽 and 🇫🇷 flags",
    "def f(x):\n    return x ** 2  # square\n\n\tif x: pass", "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>c", "    ", "\n", " \n \n ", "x" * 300, "~~~!!!???...,,,", "ٱلْعَرَبِيَّة",
    "१२३ ٣٤٥ ½ ⅓", "mixed123abc456", "e\u0301 combining", "\u00a0nbsp\u2009thin\u3000ideo", "trailing space ",
    "fin.\n\n", "x\u2028y\x85z", "£€¥ $100 @user #tag", "CamelCaseWordsHere", "a  b   c    d", "\U0001f600" * 5,
    "<|im_start|><|im_end|>", "{\"json\": [1, 2.5, null]}", "http://example.com/a?b=c&d=e#f",
    "line one\r\n  \n\tindented\n", "12345678901234567890", "x1y22z333", " (hello) [world]!\n\n  ok", "I'VE i'Ll",
    "word\u3000\u3000next", ".\n.\r\r\nend", "    four spaces then\n\n\n    code",
]


# The split patterns of Qwen's and Llama 3's byte-level tokenizers (the GPT-2 one is ByteLevel's own).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")


def _with_split(source: str, target: str, pattern: str) -> str:
    """A copy of ``source``'s tokenizer.json whose pre-tokenizer is ``pattern``'s split then the byte-level map
    (the vocabulary and merges stay: any split of the text still encodes)."""
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(source, "tokenizer.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    config["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}
    with open(os.path.join(target, "tokenizer.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    return target


def _answers(engine_exe: str, mode: str, model: str, inputs: list) -> list[dict]:
    """The executable's answers in a test mode (``--tokenize``: a text a line; ``--render-chat``: a conversation a
    line) for ``model`` (a checkpoint directory or a GGUF), one per input."""
    lines = "".join(json.dumps(item) + "\n" for item in inputs)
    out = subprocess.run([engine_exe, mode, model], input=lines.encode(), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    answers = [json.loads(line) for line in out.stdout.decode().split("\n") if line]
    assert len(answers) == len(inputs)
    return answers


def _tokenized(engine_exe: str, model: str) -> list[dict]:
    """``--tokenize`` of every text of TEXTS: its ids, their decoding whole and one token at a time."""
    return _answers(engine_exe, "--tokenize", model, TEXTS)


@pytest.mark.parametrize("split", ["gpt2", "qwen", "llama3"])
def test_tokenizer_matches_the_tokenizers_library(engine_exe, qwen3, tmp_path, split):
    """Encoding (added tokens first, the declared pre-tokenizer split, merges by rank) and decoding, whole and
    one token at a time as generation streams it, equal the ``tokenizers`` library's: on the checkpoint's own
    file (ByteLevel's GPT-2 split), and on copies of it declaring Qwen's and Llama 3's split patterns."""
    from tokenizers import Tokenizer

    directory = qwen3 if split == "gpt2" else _with_split(
        qwen3, str(tmp_path / split), QWEN_SPLIT if split == "qwen" else LLAMA3_SPLIT)
    reference = Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
    for text, answer in zip(TEXTS, _tokenized(engine_exe, directory)):
        expected = reference.encode(text, add_special_tokens=False).ids
        assert answer["ids"] == expected, text
        assert answer["decoded"] == reference.decode(expected, skip_special_tokens=False) == text
        assert answer["streamed"] == text


def test_engine_health_says_loading_then_ready(qwen3_pipe, qwen3):
    assert qwen3_pipe.first_health == {"id": "first", "state": "loading", "model": qwen3}
    qwen3_pipe.send({"op": "health", "id": 1})
    assert qwen3_pipe.router.first(1) == {"id": 1, "state": "ready", "model": qwen3}


def test_engine_chat_streams_then_done_with_usage_and_diag(qwen3_pipe):
    text, done = check_chat_usage_and_diag(qwen3_pipe, "safetensors", n=12)
    assert text and done["finish"] in ("eos", "budget")
    assert done["diag"]["route"]["architecture"] == "Qwen3ForCausalLM"


def test_engine_stop_string_finish(qwen3_pipe):
    full, _ = qwen3_pipe.request({"op": "generate", "id": "4a", "prompt": "Once upon a time", "temp": 0, "n": 16})
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop
    text, done = qwen3_pipe.request({"op": "generate", "id": 4, "prompt": "Once upon a time", "temp": 0, "n": 16,
                               "stop": ["never said", stop]})
    assert done["finish"] == "stop"
    assert text == full[:full.index(stop)]


def test_engine_sampling_fields_are_acted_on(qwen3_pipe):
    check_sampling_fields(qwen3_pipe, echo_tokens=40)


def test_engine_four_conversations_multiplexed(qwen3_pipe):
    check_four_conversations_interleave(qwen3_pipe)


def test_engine_sessions_on_the_pipe(qwen3_pipe):
    check_sessions(qwen3_pipe, "exe", n=8)


def test_engine_fuzz_lines_then_health(qwen3_pipe):
    check_fuzz_lines_answered(qwen3_pipe)
    text, done = qwen3_pipe.request({"op": "chat", "id": "post-fuzz", "messages": FRANCE, "temp": 0, "n": 4})
    assert done["done"] is True and done["usage"]["gen_tokens"] > 0


def test_engine_refuses_a_chat_template_it_cannot_render(pipe_process, qwen3, tmp_path):
    """A template outside the ChatML family is refused by name (no Jinja interpreter); generate still runs."""
    model = str(tmp_path / "other-template")
    checkpoint_without_template(qwen3, model)
    with open(os.path.join(model, "chat_template.jinja"), "w", encoding="utf-8") as handle:
        handle.write("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    proc = pipe_process("--model", model, "--ctx", "256")
    try:
        proc.wait_ready()
        _, error = proc.request({"op": "chat", "id": 1, "messages": FRANCE})
        assert "not a ChatML template" in error["error"]
        _, done = proc.request({"op": "generate", "id": 2, "prompt": "hello", "n": 2, "temp": 0})
        assert done["finish"] in ("budget", "eos")
    finally:
        proc.stop()


CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke 😀\nwith two lines"}],
    [{"role": "user", "content": "  spaces  and\ttabs  "}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "{{ not jinja }} {% raw %}"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
     {"role": "user", "content": "Q2"}],
]


@pytest.mark.parametrize("template", ["checkpoint", "qwen3_5.jinja", "r1_distill.jinja", "gemma3.jinja"])
def test_chat_rendering_matches_the_template(engine_exe, qwen3, tmp_path, template):
    """ChatML templates (the tiny checkpoint's SmolLM one, Qwen3.5's) render as transformers renders them, with
    the generation prompt; templates of other families are refused by name."""
    from transformers import AutoTokenizer

    model = qwen3
    if template != "checkpoint":
        model = checkpoint_without_template(qwen3, str(tmp_path / "model"))
        with open(os.path.join(pipe_tests.__file__.rsplit(os.sep, 1)[0], "fixtures", "chat_templates", template),
                  encoding="utf-8") as src, open(os.path.join(model, "chat_template.jinja"), "w",
                                                 encoding="utf-8") as dst:
            dst.write(src.read())
    answers = _answers(engine_exe, "--render-chat", model, CONVERSATIONS)
    if template in ("r1_distill.jinja", "gemma3.jinja"):
        assert all("not a ChatML template" in answer["error"] for answer in answers)
        return
    tokenizer = AutoTokenizer.from_pretrained(model)
    for messages, answer in zip(CONVERSATIONS, answers):
        assert answer["text"] == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_engine_signal_drains_then_exits(pipe_process, qwen3, sig, status):
    """SIGTERM or SIGINT: nothing more is read, the running request finishes, then the exit status is the pipe's
    (0, or 130 after SIGINT)."""
    proc = pipe_process("--model", qwen3, "--ctx", "512")
    try:
        proc.wait_ready()
        proc.send({"op": "generate", "id": "run", "prompt": "Once upon a time", "n": 400, "temp": 0})
        assert "chunk" in proc.router.first("run")
        proc.proc.send_signal(sig)
        assert proc.proc.wait(60) == status, proc.error_output()
        proc.reader.join(10)
        _, done = proc.router.collect("run", timeout=1)
        assert done["finish"] == "budget" and done["usage"]["gen_tokens"] == 400
        assert not proc.impure
    finally:
        proc.stop()


def _load_failure(pipe_process, model: str) -> tuple[dict, list]:
    """The executable on a ``model`` it cannot load: it exits 1; its error line, and any stray stdout lines."""
    proc = pipe_process("--model", model)
    try:
        assert proc.proc.wait(60) == 1, proc.error_output()
        proc.reader.join(10)
        return proc.router.untagged_matching(lambda line: "error" in line, timeout=1), list(proc.impure)
    finally:
        proc.stop()


def test_engine_load_failure_is_reported_then_exits_one(pipe_process, qwen3, tmp_path):
    """A checkpoint it cannot serve (here a tokenizer with a WordPiece model): health says failed, the reason
    comes as an error line, and the process exits 1, as the pipe does."""
    model = str(tmp_path / "wordpiece")
    checkpoint_without_template(qwen3, model)
    with open(os.path.join(model, "tokenizer.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    config["model"]["type"] = "WordPiece"
    with open(os.path.join(model, "tokenizer.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle)
    error, impure = _load_failure(pipe_process, model)
    assert "the model failed to load" in error["error"] and "only BPE" in error["error"]
    assert not impure


def _served(engine_exe: str, model: str, requests: list[dict], *args: str) -> dict:
    """Each request's chunks (in order) and final line, from one run of the executable on ``model`` (and ``args``)
    with the requests as its whole input (end of input drains them, then the process exits 0)."""
    lines = "".join(json.dumps(request) + "\n" for request in requests)
    out = subprocess.run([engine_exe, "--model", model, "--ctx", "512", *args], input=lines.encode(),
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode(errors="replace")
    answers: dict = {request["id"]: {"chunks": [], "done": None} for request in requests}
    for line in out.stdout.decode().split("\n"):
        if line:
            answer = json.loads(line)
            if "chunk" in answer:
                answers[answer["id"]]["chunks"].append(answer["chunk"])
            else:
                answers[answer["id"]]["done"] = answer
    return answers


def test_gguf_tokenizer_matches_transformers(engine_exe, smollm2_gguf, smollm2_hf_tokenizer):
    """The tokenizer the executable builds from the GGUF's metadata (its tokens, merges, token types and
    ``tokenizer.ggml.pre`` "smollm", which splits as GPT-2's ByteLevel) encodes and decodes as transformers'
    tokenizer of the same file, special tokens such as ``<|im_start|>`` matched whole in the text."""
    answers = _tokenized(engine_exe, smollm2_gguf)
    for text, answer in zip(TEXTS, answers):
        expected = smollm2_hf_tokenizer(text, add_special_tokens=False)["input_ids"]
        assert answer["ids"] == expected, text
        assert answer["decoded"] == smollm2_hf_tokenizer.decode(expected, skip_special_tokens=False) == text
        assert answer["streamed"] == text
    assert answers[TEXTS.index("<|im_start|><|im_end|>")]["ids"] == [1, 2]   # control tokens, whole


def test_gguf_chat_rendering_matches_transformers(engine_exe, smollm2_gguf, smollm2_hf_tokenizer):
    """The GGUF's ``tokenizer.chat_template`` (ChatML with a default system turn when the conversation has none)
    renders as transformers renders it, with the generation prompt."""
    answers = _answers(engine_exe, "--render-chat", smollm2_gguf, CONVERSATIONS)
    for messages, answer in zip(CONVERSATIONS, answers):
        assert answer["text"] == smollm2_hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                                         add_generation_prompt=True)
    assert answers[0]["text"].startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_gguf_greedy_tokens_match_the_python_engine_in_float32(engine_exe, smollm2_gguf):
    """With --weight-format float32 the executable computes in float32 from the dequantised Q4_1 weights: its
    greedy tokens (one chunk a token, since every token here decodes to whole characters) equal the Python
    engine's with float32 weights (``cpu_weight_format="float32"``) on text prompts and on a chat, whose answer
    ends on the GGUF's EOS."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    prompts = ["Once upon a time", "The quick brown fox"]
    with LLM(EngineArgs(model=smollm2_gguf, cpu_weight_format="float32")) as engine:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        expected = [engine.generate([prompt], params)[0].token_ids for prompt in prompts]
        chat = engine.chat(FRANCE, SamplingParams(max_tokens=32, temperature=0.0))[0]
        pieces = [[engine.tokenizer.decode([token], skip_special_tokens=False) for token in ids] for ids in expected]
    requests = [{"op": "generate", "id": i, "prompt": prompt, "n": 24, "temp": 0} for i, prompt in enumerate(prompts)]
    requests.append({"op": "chat", "id": "chat", "messages": FRANCE, "n": 32, "temp": 0})
    answers = _served(engine_exe, smollm2_gguf, requests, "--weight-format", "float32")
    for i, ids in enumerate(expected):
        assert len(ids) == 24 and all(pieces[i])
        assert answers[i]["chunks"] == pieces[i], prompts[i]
        assert answers[i]["done"]["finish"] == "budget" and answers[i]["done"]["usage"]["gen_tokens"] == 24
    assert chat.finish_reason == "stop" and "".join(answers["chat"]["chunks"]) == chat.text
    assert answers["chat"]["done"]["finish"] == "eos"
    assert answers["chat"]["done"]["usage"]["gen_tokens"] == len(chat.token_ids) + 1   # the EOS counted


def test_gguf_of_another_architecture_is_refused_by_name(pipe_process, tmp_path):
    """A GGUF of an architecture the native engine does not run fails to load with the architecture named."""
    import gguf
    import numpy as np

    path = str(tmp_path / "other.gguf")
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    error, _ = _load_failure(pipe_process, path)
    assert "the model failed to load" in error["error"] and "'gemma3'" in error["error"]
