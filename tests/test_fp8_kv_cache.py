"""``kv_cache_dtype="fp8"`` on CPU: the reference attention stores float8 e4m3 codes with scale 1 (the conversion
the Triton store kernels make) and widens them on read. Checked against an e4m3 rounding written from the
format's definition, on its own and as the KV values an engine with a float32 cache attends to."""

from __future__ import annotations

import pytest
import torch

import pocketllm.layers.attention_backend as attention_backend
from pocketllm.api import LLM
from pocketllm.config import EngineArgs
from pocketllm.engine.kv_snapshot import KVSnapshot
from pocketllm.errors import UnsupportedFeatureError
from pocketllm.kernels.fp8 import quantize_kv
from pocketllm.sampling_params import SamplingParams


def e4m3_round_trip(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the nearest float8 e4m3 value, from the format's definition: 3 mantissa bits, normal
    exponents from -6 (below 2**-6 subnormals in steps of 2**-9), ties to even, magnitudes beyond 448 saturating."""
    wide = x.double()
    magnitude = wide.abs()
    exponent = torch.floor(torch.log2(magnitude.clamp(min=2.0 ** -6)))
    step = torch.exp2(exponent - 3)
    rounded = torch.round(magnitude / step) * step   # (torch.round takes halves to even)
    return (torch.sign(wide) * rounded.clamp(max=448.0)).to(x.dtype)


def test_quantize_kv_is_e4m3_with_scale_one() -> None:
    """Random magnitudes over the whole range (subnormals to saturation), exact halfway cases and float32 values
    between two bfloat16 ones: the codes are the nearest e4m3 values of the float32 input itself."""
    generator = torch.Generator().manual_seed(0)
    random = torch.randn(20000, generator=generator) * torch.exp2(torch.empty(20000).uniform_(-12, 10,
                                                                                             generator=generator))
    ties = torch.tensor([1.0625, 1.1875, 3 * 2.0 ** -10, 2.0 ** -10, 0.0146484375, 232.0, 248.0, 456.0, 464.0])
    odd = torch.tensor([1.0625 + 2.0 ** -20, 1.0625 - 2.0 ** -20])   # a tie only once rounded to bfloat16
    x = torch.cat([random, ties, -ties, odd, torch.tensor([0.0, 448.0, 1e6, -1e6])])
    codes = quantize_kv(x)
    assert codes.dtype == torch.float8_e4m3fn
    expected = e4m3_round_trip(x)
    assert torch.equal(codes.float(), expected), x[codes.float() != expected][:8]
    assert codes.float()[-2:].tolist() == [448.0, -448.0]
    assert torch.equal(quantize_kv(x.to(torch.bfloat16)).float(), e4m3_round_trip(x.to(torch.bfloat16).float()))


def _llm(directory: str, kv: str, reference_step: bool = False) -> LLM:
    """A float32 engine on CPU (block size 4: prompts span several blocks), steps through the reference step
    with ``reference_step``."""
    llm = LLM(EngineArgs(model=directory, device="cpu", dtype="float32", cpu_weight_format="float32",
                         kv_cache_dtype=kv, num_kv_blocks=64, block_size=4, max_num_seqs=4))
    if reference_step:
        runner = llm._client.backend.core.runner
        runner.step_backends = [runner.host_step]
    return llm


PREFIX = [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309]
PROMPTS = [PREFIX + [400, 401, 402], PREFIX + [500], PREFIX + [600, 601, 602, 603, 604, 605]]


def _generate(llm: LLM) -> list:
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    return llm.generate(PROMPTS, params)


def _logprobs(outputs: list) -> torch.Tensor:
    return torch.tensor([[alt.logprob for entry in out.logprobs for alt in entry.top] for out in outputs])


def test_fp8_cache_attends_to_quantised_values(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batched greedy generation with a float8 cache, through the engine's own path (the fast decode path
    steps aside), with prefix caching: the same tokens and log-probabilities (1e-5) as a float32 cache holding
    the explicit e4m3 round trip of the same keys and values; a second round served from the cached float8
    prefix gives them again (1e-5: the prefill's shape differs). Against a plain float32 cache the log-probabilities
    move, but not far."""
    directory = tiny_checkpoint("llama")
    with _llm(directory, "fp8") as llm:
        runner = llm._client.backend.core.runner
        assert runner.attention_layers[0].k_cache.dtype == torch.float8_e4m3fn
        assert runner.cpu_decode is None
        fp8 = _generate(llm)
        again = _generate(llm)
    assert all(out.usage.cached_tokens >= 8 for out in again)
    assert [out.token_ids for out in again] == [out.token_ids for out in fp8]
    torch.testing.assert_close(_logprobs(again), _logprobs(fp8), rtol=0, atol=1e-5)
    with _llm(directory, "auto", reference_step=True) as llm:
        plain = _generate(llm)
    store = attention_backend.copy_rows_
    monkeypatch.setattr(attention_backend, "copy_rows_",
                        lambda cache, index, rows: store(cache, index, e4m3_round_trip(rows)))
    with _llm(directory, "auto", reference_step=True) as llm:
        assert llm._client.backend.core.runner.attention_layers[0].k_cache.dtype == torch.float32
        rounded = _generate(llm)
    assert [out.token_ids for out in rounded] == [out.token_ids for out in fp8]
    torch.testing.assert_close(_logprobs(fp8), _logprobs(rounded), rtol=0, atol=1e-5)
    # The first generated position of each prompt (the same context for both): float8 moves the
    # log-probabilities of the tokens both rank in their top 3 measurably, by well under a nat.
    deltas = []
    for out, out_plain in zip(fp8, plain):
        theirs = {alt.token_id: alt.logprob for alt in out_plain.logprobs[0].top}
        deltas += [abs(alt.logprob - theirs[alt.token_id]) for alt in out.logprobs[0].top if alt.token_id in theirs]
    assert deltas and 1e-3 < max(deltas) < 0.5, deltas


def test_fp8_cache_snapshot_round_trip(tiny_checkpoint, tmp_path) -> None:
    """A KV snapshot of a float8 cache (its codes, saved and loaded) serves the prefix in another engine, which
    then generates what the first one did."""
    directory = tiny_checkpoint("llama")
    path = str(tmp_path / "prefix.safetensors")
    with _llm(directory, "fp8") as llm:
        first = _generate(llm)
        snapshot = llm.export_prefix(PROMPTS[2])
        assert snapshot.keys[0].dtype == torch.float8_e4m3fn and snapshot.num_tokens >= 8
        snapshot.save(path)
    with _llm(directory, "fp8") as llm:
        assert llm.import_prefix(KVSnapshot.load(path)) == snapshot.num_tokens
        second = _generate(llm)
    assert [out.usage.cached_tokens for out in second][2] >= 8
    assert [out.token_ids for out in second] == [out.token_ids for out in first]
    torch.testing.assert_close(_logprobs(second), _logprobs(first), rtol=0, atol=1e-5)


def test_fp8_cache_under_tensor_parallelism(tiny_checkpoint) -> None:
    """Two CPU ranks (gloo), each with its share of the KV heads as float8: the greedy tokens of one rank."""
    tokens = []
    for ranks in (1, 2):
        args = EngineArgs(model=tiny_checkpoint("llama"), device="cpu", dtype="float32", kv_cache_dtype="fp8",
                          tensor_parallel_size=ranks, num_kv_blocks=64, block_size=4, max_model_len=128,
                          tensor_parallel_startup_timeout=120, tensor_parallel_shutdown_timeout=10)
        with LLM(args) as llm:
            outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        tokens.append([out.token_ids for out in outputs])
    assert tokens[0] == tokens[1]


def test_fp8_cache_refusals(tiny_checkpoint) -> None:
    """cpu_compile compiles the fast decode path, which does not read a float8 cache, and DeepSeek-V4's attention
    is its own: both refused by name."""
    with pytest.raises(UnsupportedFeatureError, match="kv_cache_dtype='fp8'"):
        LLM(EngineArgs(model=tiny_checkpoint("llama"), device="cpu", kv_cache_dtype="fp8", cpu_compile=True,
                       num_kv_blocks=16))
    with pytest.raises(UnsupportedFeatureError, match="kv_cache_dtype='fp8'.*DeepseekV4"):
        LLM(EngineArgs(model=tiny_checkpoint("deepseek_v4"), device="cpu", kv_cache_dtype="fp8", num_kv_blocks=16))
