"""The native plane's 4-bit weights: a GGUF whose layers are Q4_1 keeps its dense layers' linear
weights as the records of the project's AVX-512 VNNI kernel (pocketllm/kernels/cpu/q4_linear.cpp, compiled into
the native build), as the Torch backend's ``cpu_weight_format="int4"`` does; ``weight_format="float32"`` keeps the
float32 path."""

from __future__ import annotations

import pytest

from pocketllm.kernels import cpu_native

needs_kernel = pytest.mark.skipif(not cpu_native.available(), reason="the CPU has no AVX-512 VNNI (or no compiler)")

PROMPTS = [[5, 17, 301, 42, 9, 77, 100, 23], [88, 12, 3], list(range(40, 77))]


def _engine(native, path: str, weight_format: str | None = None):
    options = native.QwenEngineOptions()
    options.kv_cache_mb = 32.0
    if weight_format is not None:
        options.weight_format = weight_format
    return native.QwenEngine(path, options)


def _torch_greedy(path: str, prompts: list[list[int]], n: int, weight_format: str) -> list[list[int]]:
    from pocketllm import LLM, EngineArgs, SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    with LLM(EngineArgs(model=path, device="cpu", cpu_weight_format=weight_format)) as llm:
        return [llm.generate([prompt], params)[0].token_ids for prompt in prompts]


def _q4_1_gguf(directory, arch: str) -> str:
    """A tiny GGUF of ``arch`` whose every matrix is Q4_1, with a byte-level BPE tokenizer the Torch engine can
    build (one merge, into the last token)."""
    import gguf
    from test_loaders import ARCH_CONFIGS, quant_tensors, write_gguf

    config = ARCH_CONFIGS[arch]
    path = str(directory / f"tiny-{arch}-q4_1.gguf")
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    tensors = {name: (array, q4_1 if array.ndim == 2 else kind)
               for name, (array, kind) in quant_tensors(config, arch).items()}
    write_gguf(path, arch, config, tensors, tokenizer=True, merge=True)
    return path


@pytest.fixture(scope="module")
def tiny_q4_1(tmp_path_factory) -> str:
    return _q4_1_gguf(tmp_path_factory.mktemp("q4"), "llama")


def test_weight_format_is_checked(native, tiny_q4_1):
    with pytest.raises(ValueError, match="weight_format"):
        _engine(native, tiny_q4_1, "int8")
    assert _engine(native, tiny_q4_1, "float32").weight_format == "float32"


def test_float_checkpoints_stay_float32(native, tiny_checkpoint):
    assert _engine(native, tiny_checkpoint("qwen3")).weight_format == "float32"


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 9])
def test_records_and_products_are_the_torch_planes(native, rows):
    """The engine's records are byte for byte those pocketllm/layers/q4_linear.py packs for the Torch plane (from a
    weight on a Q4_1 grid, as a GGUF's dequantised Q4_1 matrix is), and its product is the Torch plane's kernel
    op's, bit for bit: the same source, the same activation quantisation."""
    import torch

    from pocketllm.layers import q4_linear

    generator = torch.Generator().manual_seed(rows)
    weight = q4_linear.dequantize_q4(*q4_linear.quantize_q4(torch.randn(96, 160, generator=generator)))
    records = native.q4_pack(weight.numpy())
    expected = q4_linear.pack_q4(*q4_linear.quantize_q4(weight))
    assert torch.equal(torch.from_numpy(records), expected)
    x = torch.randn(rows, 160, generator=generator)
    assert torch.equal(torch.from_numpy(native.q4_linear(x.numpy(), records)), q4_linear.matmul(x, expected))


@needs_kernel
def test_tiny_q4_1_gguf_runs_in_4_bits(native, tiny_q4_1):
    """Q4_1 layers are held as records too (a decode step reads a third of the bytes); decode steps run the 4-bit
    product, one session and the batch core alike."""
    engine = _engine(native, tiny_q4_1)
    dense = _engine(native, tiny_q4_1, "float32")
    assert (engine.weight_format, dense.weight_format) == ("int4", "float32")
    assert engine.decode_weight_bytes < dense.decode_weight_bytes / 2
    single = [engine.generate(prompt, 32) for prompt in PROMPTS]
    core = native.QwenBatchCore(engine, 4)
    for i, prompt in enumerate(PROMPTS):
        sampling = native.QwenBatchSamplingParams()
        sampling.max_new_tokens = 32
        sampling.ignore_eos = True
        core.add(f"r{i}", prompt, sampling)
    batched: dict[str, list[int]] = {}
    while core.has_work():
        for event in core.step():
            batched.setdefault(event.request_id, []).append(event.token)
    assert [batched[f"r{i}"] for i in range(len(PROMPTS))] == single


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_4_bit_decode_layers_follow_the_float32_path(native, tmp_path, arch):
    """A decode step's 4-bit layers (``q4_decode_layer``: the QKV bias of Qwen2, the per-head q/k norms of Qwen3)
    against the float32 path on the same Q4_1 weights, through ``backend="cpp"``: the log-probabilities of the top
    five tokens of every decode step agree within what 8-bit activations cost (a wrong rotation, a missing bias or
    norm moves them by whole units)."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    path = _q4_1_gguf(tmp_path, arch)
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=5, ignore_eos=True)
    runs = {}
    for fmt, held in (("auto", "int4"), ("float32", "float32")):
        with LLM(EngineArgs(model=path, backend="cpp", cpu_weight_format=fmt)) as llm:
            assert llm.engine_caps().details["weight_format"] == held
            runs[fmt] = llm.generate([PROMPTS[0], PROMPTS[2]], params)
    errors = []
    for q4, dense in zip(runs["auto"], runs["float32"]):
        for step, (ours, theirs) in enumerate(zip(q4.logprobs, dense.logprobs)):
            if step > 0 and q4.token_ids[step - 1] != dense.token_ids[step - 1]:
                break
            exact = {t.token_id: t.logprob for t in theirs.top}
            errors += [abs(t.logprob - exact[t.token_id]) for t in ours.top if t.token_id in exact and step > 0]
    # Measured with the layers' libtorch ops and with q4_decode_layer alike: at most 0.08-0.13, 0.02-0.03 on average.
    assert len(errors) >= 10 and max(errors) < 0.25 and sum(errors) / len(errors) < 0.05


def test_tiny_q4_1_gguf_in_float32_matches_the_torch_float32_path(native, tiny_q4_1):
    engine = _engine(native, tiny_q4_1, "float32")
    expected = _torch_greedy(tiny_q4_1, PROMPTS, 32, "float32")
    assert [engine.generate(prompt, 32) for prompt in PROMPTS] == expected


@pytest.fixture(scope="module")
def smollm2_prompts(smollm2_gguf) -> list[list[int]]:
    from pocketllm.loaders.checkpoint import load_checkpoint

    tokenizer = load_checkpoint(smollm2_gguf).tokenizer
    return [tokenizer.encode(text, add_special_tokens=False)
            for text in ("Once upon a time", "Water boils at", "def fibonacci(n):", "The capital of France is")]


@needs_kernel
def test_default_model_follows_the_torch_int4_path(native, smollm2_gguf, smollm2_prompts):
    """The default model in 4 bits on both planes. Their decode products are the same (above), but the rest
    differs: the Torch plane's int4 path keeps a bfloat16 KV cache, runs prompts through the records' weights in
    bfloat16 (the native engine in float32), and its LM head in 8 bits with the top 64 logits recomputed in
    float32. So greedy tokens agree until a near-tie falls the other way, which moves with any change of
    rounding (measured 29, 20, 13 and 32 of 32 tokens on these prompts, docs/native.md). Where they part, both
    planes' tokens are the float32 model's two best there, within 0.5 of each other in log-probability."""
    from pocketllm import LLM, EngineArgs, SamplingParams

    engine = _engine(native, smollm2_gguf)
    assert engine.weight_format == "int4"
    expected = _torch_greedy(smollm2_gguf, smollm2_prompts, 32, "int4")
    got = [engine.generate(prompt, 32) for prompt in smollm2_prompts]
    assert all(ours[:12] == theirs[:12] for ours, theirs in zip(got, expected))
    with LLM(EngineArgs(model=smollm2_gguf, device="cpu", cpu_weight_format="float32")) as llm:
        for prompt, ours, theirs in zip(smollm2_prompts, got, expected):
            part = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
            if part is None:
                continue
            params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2)
            best = llm.generate([prompt + ours[:part]], params)[0].logprobs[0].top
            assert {t.token_id for t in best} == {ours[part], theirs[part]}
            assert abs(best[0].logprob - best[1].logprob) < 0.5
