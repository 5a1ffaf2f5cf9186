"""The native plane's own API (pocketllm_cpp): QwenEngine against transformers, the batch core's batching, EOS,
prefix cache and seeded sampling, and QwenBatchScheduler's callbacks, polling, cancel and stop."""

from __future__ import annotations

import threading

import pytest

PROMPTS = [[5, 17, 301, 42, 9, 77, 1000, 23], [88, 12, 3], list(range(200, 237))]


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def engine(native, qwen3):
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    return native.QwenEngine(qwen3, options)


def _sampling(native, max_new_tokens, **fields):
    sampling = native.QwenBatchSamplingParams()
    sampling.max_new_tokens = max_new_tokens
    for name, value in fields.items():
        setattr(sampling, name, value)
    return sampling


def _run(core, max_steps=1000):
    """Step the core until idle: {request id: [(token, eos, finish_reason), ...]}."""
    events: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_work():
            return events
        for event in core.step():
            events.setdefault(event.request_id, []).append((event.token, event.eos, event.finish_reason))
    raise AssertionError("the batch core did not finish")


def test_module_reports_its_backend(native):
    assert native.backend == "cpu"


def test_generate_matches_transformers_greedy(native, engine, qwen3, hf_reference):
    expected = hf_reference.greedy(qwen3, PROMPTS, 12)
    assert [engine.generate(p, 12) for p in PROMPTS] == expected
    assert len(set(map(tuple, expected))) == len(PROMPTS)   # the prompts lead to different continuations


def test_qwen3_moe_matches_transformers_greedy(native, tiny_checkpoint, hf_reference):
    moe = tiny_checkpoint("qwen3_moe")
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    engine = native.QwenEngine(moe, options)
    assert engine.architecture == "Qwen3MoeForCausalLM"
    expected = hf_reference.greedy(moe, PROMPTS, 10)
    core = native.QwenBatchCore(engine, 4)
    for i, prompt in enumerate(PROMPTS):
        core.add(f"m{i}", prompt, _sampling(native, 10, ignore_eos=True))
    events = _run(core)
    assert [[t for t, _, _ in events[f"m{i}"]] for i in range(len(PROMPTS))] == expected


def test_prefill_and_decode_step_continue_one_session(engine):
    full = engine.generate(PROMPTS[0], 6)
    tokens = [engine.prefill(PROMPTS[0])] + [engine.decode_step() for _ in range(5)]
    assert tokens == full
    assert engine.session_length == len(PROMPTS[0]) + 6


def test_session_reuses_the_prefix_cache_until_reset(native, qwen3):
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 4.0
    session = native.QwenEngine(qwen3, options)
    prompt = PROMPTS[2]   # 37 tokens: two whole blocks of 16
    first = session.prefill(prompt)
    assert session.session_cached_tokens == 0
    assert session.prefill(prompt) == first and session.session_cached_tokens == 32
    session.reset()
    assert session.session_length == 0
    assert session.prefill(prompt) == first and session.session_cached_tokens == 0


def test_batched_core_matches_one_at_a_time(native, engine, qwen3, hf_reference):
    core = native.QwenBatchCore(engine, 4)
    core.set_prefill_token_budget(8)   # prompts run in chunks beside other rows' decodes
    for i, prompt in enumerate(PROMPTS):
        core.add(f"r{i}", prompt, _sampling(native, 10, ignore_eos=True))
    events = _run(core)
    expected = hf_reference.greedy(qwen3, PROMPTS, 10)
    for i in range(len(PROMPTS)):
        assert [token for token, _, _ in events[f"r{i}"]] == expected[i]
        assert events[f"r{i}"][-1][2] == "length"


def test_eos_ends_the_request_and_no_step_follows(native, engine, qwen3, hf_reference):
    expected = hf_reference.greedy(qwen3, [PROMPTS[0]], 8)[0]
    eos = expected[3]
    first = expected.index(eos)
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    options.eos_token_ids = [eos]
    with_eos = native.QwenEngine(qwen3, options)
    assert with_eos.eos_id == eos and with_eos.eos_source == "options"
    core = native.QwenBatchCore(with_eos, 2)
    core.add("a", PROMPTS[0], _sampling(native, 8))
    events = _run(core)["a"]
    assert [token for token, _, _ in events] == expected[:first + 1]
    assert events[-1] == (eos, True, "stop")
    assert not core.has_work() and not core.active("a")
    assert core.step() == []


def test_stop_token_ids_and_budget(native, engine, qwen3, hf_reference):
    expected = hf_reference.greedy(qwen3, [PROMPTS[1]], 6)[0]
    core = native.QwenBatchCore(engine, 2)
    core.add("s", PROMPTS[1], _sampling(native, 6, stop_token_ids=[expected[2]]))
    core.add("b", PROMPTS[1], _sampling(native, 2, ignore_eos=True))
    events = _run(core)
    assert events["s"][-1] == (expected[2], True, "stop") and len(events["s"]) == expected.index(expected[2]) + 1
    assert [e[0] for e in events["b"]] == expected[:2] and events["b"][-1][2] == "length"


def test_prefix_cache_serves_a_repeated_prompt(native, engine):
    core = native.QwenBatchCore(engine, 2)
    prompt = PROMPTS[2]
    core.add("first", prompt, _sampling(native, 4, ignore_eos=True))
    first = _run(core)["first"]
    hits = core.stats()["prefix_cache_hits"]
    core.add("again", prompt, _sampling(native, 4, ignore_eos=True))
    again_events = []
    while core.has_work():
        again_events += core.step()
    assert [e.token for e in again_events] == [t for t, _, _ in first]
    assert again_events[-1].cached_tokens == (len(prompt) - 1) // 16 * 16 > 0
    assert core.stats()["prefix_cache_hits"] == hits + 1


def test_seeded_sampling_is_reproducible(native, engine):
    def draw(seed):
        core = native.QwenBatchCore(engine, 1)
        core.add("x", PROMPTS[0], _sampling(native, 12, temperature=1.5, top_k=50, top_p=0.95, seed=seed,
                                            ignore_eos=True))
        return [t for t, _, _ in _run(core)["x"]]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_bad_requests_are_refused(native, engine, qwen3):
    core = native.QwenBatchCore(engine, 1)
    with pytest.raises(ValueError, match="empty"):
        core.add("e", [], _sampling(native, 2))
    with pytest.raises(ValueError, match="vocabulary"):
        core.add("v", [10**7], _sampling(native, 2))
    with pytest.raises(ValueError, match="top_p"):
        core.add("p", [1, 2], _sampling(native, 2, top_p=0.0))
    core.add("dup", [1, 2], _sampling(native, 2))
    with pytest.raises(ValueError, match="already active"):
        core.add("dup", [1, 2], _sampling(native, 2))
    assert [e.finish_reason for e in core.cancel("dup")] == ["cancelled"] and not core.has_work()
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 4.0
    with pytest.raises(RuntimeError, match="prefill"):
        native.QwenEngine(qwen3, options).decode_step()


def test_scheduler_callbacks_polling_and_caps(native, engine, qwen3, hf_reference):
    expected = hf_reference.greedy(qwen3, PROMPTS[:2], 5)
    scheduler = native.QwenBatchScheduler(engine, max_batch_size=4)
    caps = scheduler.engine_caps()
    assert caps.continuous_batching and caps.chunked_prefill and caps.paged_kv and caps.per_request_sampling
    assert scheduler.max_batch_size() == min(4, caps.max_slots)
    scheduler.set_prefill_token_budget(0)
    streamed: list[int] = []
    done = threading.Event()
    results = []

    def on_token(request_id, token):
        streamed.append(token)

    def on_complete(result):
        results.append(result)
        done.set()

    first = scheduler.submit_request(PROMPTS[0], _sampling(native, 5, ignore_eos=True), callback=on_complete,
                                     on_token=on_token)
    polled = scheduler.submit_request(PROMPTS[1], _sampling(native, 5, ignore_eos=True))
    assert done.wait(60)
    result = scheduler.poll_result(polled, timeout_ms=60000)
    scheduler.stop()
    assert results[0].request_id == first and results[0].tokens == expected[0] == streamed
    assert results[0].finish_reason == "length" and results[0].completion_tokens == 5
    assert result.tokens == expected[1] and result.prompt_tokens == len(PROMPTS[1])


def test_scheduler_cancel_poll_timeout_and_callback_errors(native, engine, capfd):
    scheduler = native.QwenBatchScheduler(engine, max_batch_size=2)
    started = threading.Event()

    def on_token(request_id, token):
        started.set()
        raise RuntimeError("a callback that fails")

    long_id = scheduler.submit_request(PROMPTS[2], _sampling(native, 100000, ignore_eos=True), on_token=on_token)
    assert started.wait(60)
    assert scheduler.poll_result(long_id, timeout_ms=1) is None   # thousands of steps to go
    assert scheduler.cancel(long_id)
    result = scheduler.poll_result(long_id, timeout_ms=60000)
    assert result.finish_reason == "cancelled" and 0 < len(result.tokens) < 100000
    assert not scheduler.cancel(long_id)
    scheduler.stop()
    scheduler.stop()
    assert "a callback that fails" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="stopped"):
        scheduler.submit_request(PROMPTS[0], _sampling(native, 2))


def test_preemption_when_blocks_run_out_keeps_results_exact(native, qwen3, hf_reference):
    options = native.QwenEngineOptions()
    options.block_size = 4
    options.num_kv_blocks = 12   # 48 positions: three 20-token sequences cannot all hold their blocks
    small = native.QwenEngine(qwen3, options)
    assert small.max_model_len == 48
    prompts = [p[:8] for p in (PROMPTS[0], PROMPTS[2], list(range(400, 420)))]
    core = native.QwenBatchCore(small, 3)
    core.set_prefill_token_budget(3)
    for i, prompt in enumerate(prompts):
        core.add(f"p{i}", prompt, _sampling(native, 12, ignore_eos=True))
    events = _run(core)
    assert core.stats()["num_preemptions"] > 0
    expected = hf_reference.greedy(qwen3, prompts, 12)
    assert [[t for t, _, _ in events[f"p{i}"]] for i in range(3)] == expected
    with pytest.raises(ValueError, match="context"):
        core.add("long", list(range(1, 49)), _sampling(native, 2))


def test_llama_gguf_matches_the_python_engine_in_float32(native, smollm2_gguf):
    """A .gguf checkpoint (the default model, Q4_1 layers and a Q8_0 embedding dequantised to float32 at load,
    llama.cpp's q/k row permutation undone): its config and EOS come from the metadata, and its greedy tokens
    equal the Python engine's with float32 weights."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    options.weight_format = "float32"   # "auto" keeps the Q4_1 layers in 4 bits (tests/test_native_q4.py)
    engine = native.QwenEngine(smollm2_gguf, options)
    assert engine.architecture == "LlamaForCausalLM" and engine.weight_format == "float32"
    assert (engine.eos_id, engine.eos_source) == (2, "config")
    with LLM(EngineArgs(model=smollm2_gguf, cpu_weight_format="float32")) as reference:
        prompts = [reference.tokenizer.encode(text, add_special_tokens=False)
                   for text in ("Once upon a time", "def fibonacci(n):")]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        expected = [reference.generate([prompt], params)[0].token_ids for prompt in prompts]
    assert [engine.generate(prompt, 16) for prompt in prompts] == expected


# Every GGML type the native engine dequantises, on the (llama: permuted) q/k rows as well as elsewhere.
NATIVE_GGUF_TYPES = {
    "token_embd.weight": "Q8_0", "output.weight": "Q4_1",
    "blk.0.attn_q.weight": "Q4_1", "blk.0.attn_k.weight": "Q4_0", "blk.0.attn_v.weight": "Q8_0",
    "blk.0.attn_output.weight": "F16", "blk.0.ffn_gate.weight": "BF16", "blk.0.ffn_up.weight": "Q4_1",
    "blk.0.ffn_down.weight": "F32",
    "blk.1.attn_q.weight": "F16", "blk.1.attn_k.weight": "Q8_0", "blk.1.attn_v.weight": "Q4_1",
    "blk.1.attn_output.weight": "Q4_0", "blk.1.ffn_gate.weight": "Q4_1", "blk.1.ffn_up.weight": "BF16",
    "blk.1.ffn_down.weight": "Q8_0",
}


@pytest.mark.parametrize("arch, hf_class", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                            ("qwen3", "Qwen3ForCausalLM")])
def test_gguf_of_every_read_type_matches_transformers(native, tmp_path, hf_reference, arch, hf_class):
    """A tiny random GGUF whose matrices are F32, F16, BF16, Q8_0, Q4_0 and Q4_1 (llama: q and k permuted the
    llama.cpp way; qwen2: q/k/v biases; qwen3: per-head q/k norms): greedy tokens equal transformers' float32
    model of the same file."""
    from gguf import GGMLQuantizationType
    from test_loaders import ARCH_CONFIGS, quant_tensors, write_gguf

    config = ARCH_CONFIGS[arch]
    tensors = {name: (array, GGMLQuantizationType[NATIVE_GGUF_TYPES.get(name, "F32")])
               for name, (array, _) in quant_tensors(config, arch).items()}
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_gguf(path, arch, config, tensors)
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 16.0
    options.weight_format = "float32"   # transformers computes in float32 (mostly-Q4_1 layers would run in 4 bits)
    engine = native.QwenEngine(path, options)
    assert engine.architecture == hf_class and engine.vocab_size == config["vocab_size"]
    prompts = [[5, 17, 301, 42, 9, 77, 100, 23], [88, 12, 3]]
    expected = hf_reference.greedy(path, prompts, 10)
    assert [engine.generate(prompt, 10) for prompt in prompts] == expected
    assert len(set(map(tuple, expected))) == len(prompts)
