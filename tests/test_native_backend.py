"""backend='cpp' behind LLM and AsyncLLM: refusals before anything loads, the auto rule, greedy parity with
backend='torch' on a batch, EOS, streaming, cancellation and the declared capabilities."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from pocketllm import LLM, AsyncLLM, EngineArgs, SamplingParams
from pocketllm.backends import native as native_module
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.kernels import cpu_native
from pocketllm.sampling_params import StructuredOutput

PROMPTS = ["Once upon a time", "The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]


def _greedy(n: int, **fields) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **fields)


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def cpp_llm(native, qwen3):
    with LLM(EngineArgs(model=qwen3, backend="cpp", cpu_kv_cache_gb=0.05)) as llm:
        yield llm


@pytest.mark.parametrize("fields", [
    {"tensor_parallel_size": 2}, {"dtype": "bfloat16"}, {"cpu_weight_format": "int4"},
    {"kv_cache_dtype": "bfloat16"}, {"load_format": "dummy"},
    {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
])
def test_unsupported_options_are_refused_before_loading(qwen3, fields, monkeypatch):
    monkeypatch.setattr(native_module, "import_native", lambda: pytest.fail("the native module was imported"))
    with pytest.raises(UnsupportedFeatureError, match=next(iter(fields))):
        LLM(EngineArgs(model=qwen3, backend="cpp", **fields))


def test_a_cuda_device_needs_a_cuda_build(qwen3, monkeypatch):
    """The module is imported to ask what it was built for, and nothing more: a CPU build refuses a CUDA device
    naming it, a CUDA build lets it through to the engine."""
    monkeypatch.setattr(native_module, "import_native", lambda: SimpleNamespace(backend="cpu"))
    with pytest.raises(UnsupportedFeatureError, match="device"):
        native_module.check_args(EngineArgs(model=qwen3, backend="cpp", device="cuda"))
    monkeypatch.setattr(native_module, "import_native", lambda: SimpleNamespace(backend="cuda"))
    native_module.check_args(EngineArgs(model=qwen3, backend="cpp", device="cuda"))


def test_unsupported_checkpoints_are_refused(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(native_module, "import_native", lambda: pytest.fail("the native module was imported"))
    for probe in ("is_available", "device_count", "_lazy_init", "init"):   # refused before CUDA is asked about
        monkeypatch.setattr(torch.cuda, probe, lambda *a, p=probe: pytest.fail(f"torch.cuda.{p} was called"))
    import gguf

    other = str(tmp_path / "other.gguf")   # a GGUF of an architecture the native reader does not run
    writer = gguf.GGUFWriter(other, "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for model, what in ((tiny_checkpoint("llama"), "model_type 'llama'"), (tiny_checkpoint("qwen2"), "qwen2"),
                        (other, "architecture 'gemma3'"), (str(tmp_path), "architecture 'gemma3'"),
                        (str((tmp_path / "empty").mkdir() or tmp_path / "empty"), "neither")):
        with pytest.raises(UnsupportedFeatureError, match=f"native plane.*{what}"):
            LLM(EngineArgs(model=model, backend="cpp"))
    with pytest.raises(InvalidRequestError, match="backend_options"):
        LLM(EngineArgs(model=tiny_checkpoint("qwen3"), backend="cpp", backend_options={"knob": 1}))


def test_the_default_gguf_runs_natively(native, smollm2_gguf):
    """backend='cpp' with no model runs the default model's GGUF: float32 tokens equal the Torch backend's, the
    4-bit layers ("auto") keep the Torch int4 path's first tokens, and prompt lookup changes no token."""
    prompts = ["Once upon a time", "The capital of France is"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = {}
    for weights in ("float32", "auto"):
        with LLM(EngineArgs(model=smollm2_gguf, backend="torch", cpu_weight_format=weights)) as torch_llm:
            expected[weights] = [o.token_ids for o in torch_llm.generate(prompts, params)]
    with LLM(EngineArgs(backend="cpp", cpu_weight_format="float32", cpu_kv_cache_gb=0.05)) as llm:
        details = llm.engine_caps().details
        assert details["format"] == "gguf" and details["weight_format"] == "float32"
        assert details["architecture"] == "LlamaForCausalLM"
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected["float32"]
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with LLM(EngineArgs(model=smollm2_gguf, backend="cpp", cpu_kv_cache_gb=0.05)) as llm:
        if not cpu_native.available():   # the 4-bit layers need the project's kernels: float32 instead
            assert llm.engine_caps().details["weight_format"] == "float32"
            pytest.skip("the CPU has no AVX-512 VNNI (or no compiler): the 4-bit layers are held in float32")
        assert llm.engine_caps().details["weight_format"] == "int4"
        plain = [o.token_ids for o in llm.generate(prompts, params)]
        assert [t[:16] for t in plain] == [t[:16] for t in expected["auto"]]
    with LLM(EngineArgs(model=smollm2_gguf, backend="cpp", cpu_kv_cache_gb=0.05, speculative_config=spec)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain


def test_a_missing_module_names_the_build(qwen3, monkeypatch):
    monkeypatch.setattr(native_module, "import_native", lambda: None)
    with pytest.raises(UnsupportedFeatureError, match="POCKETLLM_BUILD_CPP=1"):
        LLM(EngineArgs(model=qwen3, backend="cpp"))


@pytest.fixture
def built(monkeypatch):
    """The auto rule as on a CPU-only machine where the native module is built (neither is asked for real)."""
    monkeypatch.setattr(native_module, "import_native", lambda: SimpleNamespace(backend="cpu"))
    monkeypatch.setattr(native_module, "_cuda_available", lambda: False)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_auto_picks_native_for_qwen3_5_safetensors(built, tiny_checkpoint, arch):
    assert native_module.auto_picks_native(EngineArgs(model=tiny_checkpoint(arch)))
    assert native_module.auto_picks_native(EngineArgs(model=tiny_checkpoint(arch), device="cpu",
                                                      backend_options={"eos_token_id": 2}))


def test_auto_stays_on_torch_for_other_checkpoints(built, qwen3, tiny_checkpoint, smollm2_gguf, monkeypatch, caplog):
    monkeypatch.setattr(native_module, "import_native", lambda: pytest.fail("the native module was imported"))
    caplog.set_level("INFO", logger="pocketllm.backend")
    for model in (qwen3, tiny_checkpoint("qwen3_moe"), tiny_checkpoint("llama"), smollm2_gguf, None,
                  "qwen3.5-9b"):   # Qwen3 (dense and MoE), other families, a GGUF, the default model, a preset
        assert not native_module.auto_picks_native(EngineArgs(model=model))
    assert not caplog.records


def test_auto_stays_on_torch_without_the_module(tiny_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(native_module, "import_native", lambda: None)
    caplog.set_level("INFO", logger="pocketllm.backend")
    assert not native_module.auto_picks_native(EngineArgs(model=tiny_checkpoint("qwen3_5_text"), dtype="bfloat16"))
    assert not caplog.records


@pytest.mark.parametrize("fields", [
    {"dtype": "bfloat16"}, {"device": "cuda"}, {"cpu_weight_format": "int4"}, {"quantization": "fp8"},
    {"kv_cache_dtype": "bfloat16"}, {"async_scheduling": "on"}, {"load_format": "dummy"},
    {"speculative_config": {"method": "mtp", "num_speculative_tokens": 2}},
    {"backend_options": {"knob": 1}},
])
def test_auto_stays_on_torch_for_options_the_native_plane_refuses(built, tiny_checkpoint, fields, caplog):
    caplog.set_level("INFO", logger="pocketllm.backend")
    assert not native_module.auto_picks_native(EngineArgs(model=tiny_checkpoint("qwen3_5_text"), **fields))
    name = next(iter(fields))
    assert [r.levelname for r in caplog.records] == ["INFO"] and name in caplog.records[0].getMessage()
    if name != "backend_options":   # backend='cpp' refuses the same options
        with pytest.raises(UnsupportedFeatureError, match=name):
            native_module.check_args(EngineArgs(model=tiny_checkpoint("qwen3_5_text"), backend="cpp", **fields))


def test_auto_stays_on_torch_where_device_auto_means_cuda(built, tiny_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(native_module, "_cuda_available", lambda: True)
    caplog.set_level("INFO", logger="pocketllm.backend")
    model = tiny_checkpoint("qwen3_5_text")
    assert not native_module.auto_picks_native(EngineArgs(model=model))
    assert "device='auto'" in caplog.records[0].getMessage()
    assert native_module.auto_picks_native(EngineArgs(model=model, device="cpu"))   # CPU asked for: native
    monkeypatch.setattr(native_module, "import_native", lambda: SimpleNamespace(backend="cuda"))
    assert native_module.auto_picks_native(EngineArgs(model=model))   # a CUDA build runs there


def test_auto_runs_qwen3_5_on_the_native_plane_with_torch_greedy_tokens(native, tiny_checkpoint):
    model = tiny_checkpoint("qwen3_5_text")
    with LLM(EngineArgs(model=model, backend="torch", num_kv_blocks=64)) as torch_llm:
        expected = torch_llm.generate(PROMPTS, _greedy(12, ignore_eos=True))
    with LLM(EngineArgs(model=model, cpu_kv_cache_gb=0.05)) as llm:
        assert llm.engine_client.backend.name == "cpp"
        outputs = llm.generate(PROMPTS, _greedy(12, ignore_eos=True))
        # What the native plane does not do is refused, naming the field and the backend that does it.
        with pytest.raises(UnsupportedFeatureError, match="structured.*backend='torch'"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, structured_output=StructuredOutput(
                json_object=True)))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    with LLM(EngineArgs(model=model, dtype="bfloat16", num_kv_blocks=64)) as llm:   # an option it refuses
        assert llm.engine_client.backend.name == "torch"
    with LLM(EngineArgs(model=tiny_checkpoint("qwen3"), num_kv_blocks=64)) as llm:   # not Qwen3.5
        assert llm.engine_client.backend.name == "torch"


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text"])
def test_batched_greedy_tokens_equal_the_torch_backend(native, tiny_checkpoint, arch):
    model = tiny_checkpoint(arch)
    with LLM(EngineArgs(model=model, backend="torch")) as torch_llm:
        expected = torch_llm.generate(PROMPTS, _greedy(16, ignore_eos=True))
    with LLM(EngineArgs(model=model, backend="cpp", cpu_kv_cache_gb=0.05)) as cpp_llm:
        outputs = cpp_llm.generate(PROMPTS, _greedy(16, ignore_eos=True))
        # Qwen3.5 too: its prefix cache resumes from recurrent states kept at prompts' block boundaries.
        assert cpp_llm.engine_caps().prefix_caching
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert all(o.finish_reason == "length" and o.usage.completion_tokens == 16 for o in outputs)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_5_text"])
def semantics_llm(native, tiny_checkpoint, request):
    """backend='cpp' on a tiny Qwen3 and a tiny Qwen3.5 (recurrent state beside the paged cache)."""
    with LLM(EngineArgs(model=tiny_checkpoint(request.param), backend="cpp", cpu_kv_cache_gb=0.05)) as llm:
        yield llm


def test_capabilities_follow_the_native_engine(cpp_llm):
    caps = cpp_llm.engine_caps()
    assert caps.continuous_batching and caps.paged_kv and caps.prefix_caching and caps.per_request_sampling
    assert caps.logprobs and caps.max_logprobs == 20 and caps.penalties and caps.logit_bias
    assert not (caps.structured_outputs or caps.speculative)
    assert caps.details["backend"] == "cpp" and caps.details["device"] == "cpu"
    assert cpp_llm.engine_client.backend.name == "cpp"
    with pytest.raises(UnsupportedFeatureError, match="structured"):
        cpp_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, structured_output=StructuredOutput(
            json_object=True)))
    with pytest.raises(UnsupportedFeatureError, match="prefix"):
        cpp_llm.export_prefix([1, 2, 3])
    assert cpp_llm.generate(PROMPTS[0], _greedy(2, ignore_eos=True))[0].usage.completion_tokens == 2


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5_text"])
def test_eos_is_excluded_and_counted(native, tiny_checkpoint, arch):
    args = EngineArgs(model=tiny_checkpoint(arch), backend="cpp", cpu_kv_cache_gb=0.05)
    with LLM(args) as llm:
        free = llm.generate(PROMPTS[1], _greedy(12, ignore_eos=True))[0]
    eos = free.token_ids[4]
    cut = free.token_ids.index(eos)
    with LLM(args.replace(backend_options={"eos_token_id": eos})) as llm:
        assert llm.engine_caps().details["eos_source"] == "backend_options"
        out = llm.generate(PROMPTS[1], _greedy(12))[0]
        streamed = list(llm.generate_stream(PROMPTS[1], _greedy(12)))
    assert out.token_ids == free.token_ids[:cut] and out.finish_reason == "stop"
    assert out.usage.completion_tokens == cut + 1   # the EOS step counts
    assert [t for e in streamed for t in e.token_ids] == out.token_ids
    assert streamed[-1].finish_reason == "stop" and streamed[-1].usage.completion_tokens == cut + 1


def test_streaming_equals_offline_and_stop_strings_apply(semantics_llm):
    whole = semantics_llm.generate(PROMPTS[2], _greedy(16, ignore_eos=True))[0]
    events = list(semantics_llm.generate_stream(PROMPTS[2], _greedy(16, ignore_eos=True)))
    assert "".join(e.text for e in events) == whole.text and events[-1].finished
    assert [t for e in events for t in e.token_ids] == whole.token_ids
    stop = whole.text[len(whole.text) // 2:][:3]
    if stop.strip():
        stopped = semantics_llm.generate(PROMPTS[2], _greedy(16, ignore_eos=True, stop=[stop]))[0]
        assert stopped.finish_reason == "stop" and stopped.text == whole.text[:whole.text.index(stop)]


def _idle(stats) -> dict:
    """The engine's counters once no request runs (a stop string's request is ended after its output went out)."""
    deadline = time.monotonic() + 5
    while stats()["num_requests_running"] + stats()["num_requests_waiting"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return stats()


def test_cancel_frees_the_native_blocks(semantics_llm):
    stats = semantics_llm.stats
    free_before = _idle(stats)["kv_cache_free_blocks"]
    assert free_before == stats()["kv_cache_total_blocks"]
    params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
    events = semantics_llm.generate_stream(PROMPTS[0] * 8, params, request_id="to-cancel")
    next(events)
    assert semantics_llm.cancel("to-cancel") is True
    rest = list(events)
    assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
    assert semantics_llm.cancel("to-cancel") is False
    deadline = time.monotonic() + 5
    while stats()["kv_cache_free_blocks"] != free_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats()["kv_cache_free_blocks"] == free_before


def test_seeded_requests_reproduce(cpp_llm):
    params = SamplingParams(max_tokens=12, temperature=1.2, top_k=40, top_p=0.9, seed=11, ignore_eos=True)
    first, second = (cpp_llm.generate(PROMPTS[3], params)[0].token_ids for _ in range(2))
    assert first == second


def test_async_llm_streams_over_the_native_plane(native, qwen3):
    async def main() -> tuple[list[str], list[str]]:
        async with AsyncLLM(EngineArgs(model=qwen3, backend="cpp", cpu_kv_cache_gb=0.05)) as llm:
            async def one(prompt: str) -> str:
                return "".join([e.text async for e in llm.generate_stream(prompt, _greedy(8, ignore_eos=True))])

            streamed = await asyncio.gather(*(one(p) for p in PROMPTS))
            whole = await llm.generate(PROMPTS, _greedy(8, ignore_eos=True))
            return list(streamed), [o.text for o in whole]

    streamed, whole = asyncio.run(main())
    assert streamed == whole


def test_the_pipe_serves_the_native_plane(native, qwen3, monkeypatch):
    from harness_utils import PipeProcess

    with LLM(EngineArgs(model=qwen3, backend="torch")) as torch_llm:
        expected = torch_llm.generate("The quick brown fox", _greedy(6, ignore_eos=True))[0].text
    monkeypatch.setenv("POCKETLLM_BACKEND", "cpp")
    monkeypatch.setenv("POCKETLLM_CPU_KV_CACHE_GB", "0.05")
    proc = PipeProcess("--model", qwen3)
    try:
        proc.wait_ready()
        text, done = proc.request({"op": "generate", "id": 1, "prompt": "The quick brown fox", "n": 6, "temp": 0,
                                   "diag": True})
        assert text == expected and done["finish"] == "budget" and done["usage"]["gen_tokens"] == 6
        assert done["diag"]["route"]["backend"] == "cpp"
        proc.send({"op": "generate", "id": 2, "prompt": "Count: 1, 2, 3", "n": 100000, "temp": 0})
        proc.router.first(2)
        proc.send({"op": "cancel", "id": 2})
        lines = [proc.router.first(2) for _ in range(1)]
        while not (lines[-1].get("done") or "error" in lines[-1]):
            lines.append(proc.router.first(2))
        assert lines[-1]["finish"] == "cancel"
    finally:
        proc.stop()
    assert not proc.impure


def test_the_server_serves_the_native_plane(native, qwen3):
    import httpx
    from server_utils import ServerProcess

    with LLM(EngineArgs(model=qwen3, backend="torch")) as torch_llm:
        expected = torch_llm.generate("Once upon a time", _greedy(8, ignore_eos=True))[0].text
    proc = ServerProcess("--model", qwen3, "--backend", "cpp", "--cpu-kv-cache-gb", "0.05")
    try:
        proc.wait_ready()
        body = {"model": "x", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        response = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        refused = httpx.post(proc.url + "/v1/completions", timeout=120,
                             json={**body, "response_format": {"type": "json_object"}})
        assert refused.status_code == 400, refused.text
        chat = httpx.post(proc.url + "/v1/chat/completions", timeout=120, json={
            "model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": True})
        assert chat.status_code == 200 and chat.text.rstrip().endswith("data: [DONE]")
    finally:
        proc.stop()


def test_logprobs_equal_the_torch_backend(cpp_llm, qwen3):
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(EngineArgs(model=qwen3, backend="torch")) as torch_llm:
        expected = torch_llm.generate(PROMPTS[:2], params)
    outputs = cpp_llm.generate(PROMPTS[:2], params)
    for out, ref in zip(outputs, expected):
        assert out.token_ids == ref.token_ids and len(out.logprobs) == 6
        for mine, theirs in zip(out.logprobs, ref.logprobs):
            assert mine.token_id == theirs.token_id and mine.token == theirs.token
            assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-4)
            assert [alt.token_id for alt in mine.top] == [alt.token_id for alt in theirs.top]
            assert [alt.logprob for alt in mine.top] == pytest.approx([alt.logprob for alt in theirs.top], abs=1e-4)
    assert cpp_llm.generate(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))[0].logprobs is None


def test_penalties_and_logit_bias_equal_the_torch_backend(cpp_llm, qwen3):
    prompt = PROMPTS[1]   # its greedy continuation repeats a token, which the penalties change
    base = cpp_llm.generate(prompt, _greedy(8, ignore_eos=True))[0].token_ids
    cases = [
        {"repetition_penalty": 1.8}, {"frequency_penalty": 1.5, "presence_penalty": 0.7},
        {"logit_bias": {base[1]: -100.0, 4242: 30.0}},
    ]
    with LLM(EngineArgs(model=qwen3, backend="torch")) as torch_llm:
        expected = [torch_llm.generate(prompt, _greedy(8, ignore_eos=True, **case))[0].token_ids
                    for case in cases]
    got = [cpp_llm.generate(prompt, _greedy(8, ignore_eos=True, **case))[0].token_ids for case in cases]
    assert got == expected
    assert got[2][1] == 4242 and base[1] not in got[2]
    assert got[0] != base and got[1] != base


def test_min_p_of_one_keeps_only_the_most_likely_token(cpp_llm):
    greedy = cpp_llm.generate(PROMPTS[0], _greedy(10, ignore_eos=True))[0].token_ids
    sampled = cpp_llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=5.0, min_p=1.0, seed=3,
                                                          ignore_eos=True))[0].token_ids
    wide = cpp_llm.generate(PROMPTS[0], SamplingParams(max_tokens=10, temperature=5.0, seed=3,
                                                       ignore_eos=True))[0].token_ids
    assert sampled == greedy != wide
