"""The native plane's device-independent form (``QwenEngineOptions.aten_ops``: attention and the Gated DeltaNet as
ATen operations, the form a CUDA build runs on the GPU): greedy tokens equal transformers (fp32) on tiny Qwen3,
Qwen3-MoE, Qwen3.5 and Qwen3.5-MoE checkpoints, batched with chunked prefill, through the prefix cache and with
prompt-lookup verify chunks; log-probabilities within 1e-4. The same tests run on a CUDA device (``-m gpu``) where
the module is a CUDA build; a CPU build refuses ``device="cuda"`` naming the build option."""

from __future__ import annotations

import pytest
import torch
from native_utils import greedy_by_arch, greedy_sampling, mixed_prompts, run_batched, small_engine

ARCHS = ("qwen3", "qwen3_moe", "qwen3_5_text", "qwen3_5_moe_text")
NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 17, 40, 9)

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts() -> list[list[int]]:
    return mixed_prompts(PROMPT_LENGTHS)


@pytest.fixture(params=["cpu-aten", pytest.param("cuda", marks=pytest.mark.gpu)])
def device_options(request, native) -> dict:
    """QwenEngineOptions fields for the form under test: ATen operations on the CPU, or a CUDA device."""
    if request.param == "cpu-aten":
        return {"device": "cpu", "aten_ops": True}
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if native.backend != "cuda":
        pytest.skip("needs a CUDA device and a CUDA build of the native module (-DPOCKET_BACKEND=cuda)")
    return {"device": "cuda"}


@pytest.fixture(scope="module")
def expected(tiny_checkpoint, hf_reference):
    """transformers' greedy continuations of the prompts, once per arch."""
    return greedy_by_arch(hf_reference, tiny_checkpoint, _prompts(), NEW_TOKENS)


def _batched(native, engine, prompts, budget=16, ngram=None, cached=None) -> list[list[int]]:
    """Greedy tokens of every prompt, run together through a batch core with ``budget`` prompt tokens a step;
    ``cached`` (a dict) gets each prompt's tokens taken from the prefix cache."""
    tokens, taken, _ = run_batched(native, engine, prompts, NEW_TOKENS, 4, budget, ngram)
    if cached is not None:
        cached.update(taken)
    return [tokens[i] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_chunked_greedy_equals_transformers(native, tiny_checkpoint, expected, device_options, arch):
    engine = small_engine(native, tiny_checkpoint(arch), **device_options)
    assert engine.device.startswith(device_options["device"])
    assert engine.options.aten_ops == device_options.get("aten_ops", False)
    assert _batched(native, engine, _prompts()) == expected(arch)


@pytest.mark.parametrize("arch", ("qwen3", "qwen3_5_text"))
def test_prefix_cache_and_verify_chunks_keep_the_tokens(native, tiny_checkpoint, expected, device_options, arch):
    """A second run of the same prompts resumes from the prefix cache (Qwen3.5: from kept states), and prompt
    lookup's verify chunks (several query rows past a cached context) change no token."""
    engine = small_engine(native, tiny_checkpoint(arch), **device_options)
    first: dict[int, int] = {}
    assert _batched(native, engine, _prompts(), cached=first) == expected(arch)
    again: dict[int, int] = {}
    assert _batched(native, engine, _prompts(), ngram=(3, 1, 3), cached=again) == expected(arch)
    assert first[2] == 0 and again[2] == 32   # the 40-token prompt's two whole blocks of 16
    assert engine.device.startswith(device_options["device"])


def test_logprobs_equal_transformers(native, tiny_checkpoint, hf_reference, device_options):
    path = tiny_checkpoint("qwen3_5_text")
    engine = small_engine(native, path, **device_options)
    prompt = _prompts()[1]
    core = native.QwenBatchCore(engine, 1)
    core.add("lp", prompt, greedy_sampling(native, 6, logprobs=5))
    events = []
    while core.has_work():
        events.extend(core.step())
    tokens = [e.token for e in events]
    logits = hf_reference.logits(path, prompt + tokens[:-1], True)[len(prompt) - 1:]
    for event, row in zip(events, torch.log_softmax(logits.float(), -1)):
        assert abs(event.logprob - row[event.token].item()) < 1e-4
        assert max(abs(a - row[t].item()) for a, t in zip(event.top_logprobs, event.top_ids)) < 1e-4


def test_a_cpu_build_refuses_a_cuda_device(native, tiny_checkpoint):
    path = tiny_checkpoint("qwen3")
    if native.backend == "cpu":
        with pytest.raises(ValueError, match="POCKET_BACKEND=cuda"):
            small_engine(native, path, device="cuda")
    else:
        assert native.backend == "cuda"
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
        small_engine(native, path, device="tpu")
    assert small_engine(native, path, device="cpu").device == "cpu"
