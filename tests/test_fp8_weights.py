"""``quantization="fp8"``: float8 e4m3 weights with per-row scales, against transformers running the same
quantised weights in fp32 (the CPU path widens the codes; the CUDA kernels are in test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError
from pocketllm.kernels.fp8 import FP8_MAX, dequantize_weight, quantize_weight, scaled_product


def test_quantised_weights_are_within_e4m3_rounding_of_the_original() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]
    weight[5] = 0.0
    codes, scale = quantize_weight(weight)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_weight(codes, scale)
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4 for normal values, and at most half the
    # smallest subnormal step (2^-10 of the scale) near zero
    bound = torch.maximum(weight.abs() * 2 ** -4, scale[:, None] * 2 ** -10) * (1 + 1e-6)
    assert bool(((back - weight).abs() <= bound).all())
    assert torch.equal(codes.float().abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), FP8_MAX))
    assert float(scale[5]) == 1.0 and not bool(back[5].any())          # an all-zero row stays zero
    again = quantize_weight(back)                                        # quantising its own output changes nothing
    assert torch.equal(again[0].float(), codes.float()) and torch.allclose(again[1], scale)


def test_scaled_product_is_the_dequantised_product() -> None:
    torch.manual_seed(1)
    codes, scale = quantize_weight(torch.randn(48, 32))
    bias = torch.randn(48)
    x = torch.randn(2, 5, 32)
    expected = x @ dequantize_weight(codes, scale).T + bias
    torch.testing.assert_close(scaled_product(x, codes, scale, bias), expected, rtol=1e-5, atol=1e-5)


def _fp8_reference_model(directory: str):
    """transformers' fp32 model of ``directory`` with every decoder-layer linear weight and the LM head replaced
    by its float8 round trip (what ``quantization="fp8"`` computes with; the embedding untouched, also where the
    head is tied to it)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize_weight(*quantize_weight(module.weight)))
        head = model.get_output_embeddings()
        head.weight = torch.nn.Parameter(dequantize_weight(*quantize_weight(head.weight)), requires_grad=False)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_transformers_on_the_quantised_weights(arch: str, tiny_checkpoint) -> None:
    """Batched, mixed prompt lengths, chunked prefill: every token is transformers' greedy token on the same
    float8 weights, and the top log-probabilities agree; the unquantised model answers differently."""
    directory = tiny_checkpoint(arch)
    prompts = [[(1000 + 7919 * (i + 1) * (n + 3)) % 49152 for i in range(length)]
               for n, length in enumerate((5, 17, 40))]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    with LLM(EngineArgs(model=directory, device="cpu", quantization="fp8", num_kv_blocks=64,
                        max_num_batched_tokens=16)) as llm:
        assert llm.engine_caps().details["quantization"] == "fp8"
        outputs = llm.generate(prompts, params)
    reference = _fp8_reference_model(directory)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                                      eos_token_id=[], pad_token_id=0)[0, len(prompt):].tolist()
        assert out.token_ids == expected
        with torch.no_grad():
            logprobs = torch.log_softmax(reference(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
        for i, entry in enumerate(out.logprobs):
            row = logprobs[len(prompt) - 1 + i]
            for alt in entry.top:
                assert abs(alt.logprob - float(row[alt.token_id])) < 1e-4
    # the quantisation is real: the weights it ran differ from the checkpoint's
    with LLM(EngineArgs(model=directory, device="cpu", num_kv_blocks=64)) as plain:
        unquantised = plain.generate(prompts, params)
    assert any(abs(a.logprob - b.logprob) > 1e-4
               for q, u in zip(outputs, unquantised) for a, b in zip(q.logprobs, u.logprobs))


def test_a_tied_head_gets_codes_of_its_own(tiny_checkpoint) -> None:
    """Qwen3's tiny checkpoint ties its head to the embedding: with fp8 the head holds float8 codes, the
    embedding keeps its rows, and the bytes a decode step reads count the head's codes and scales, not the
    table (which is only looked up)."""
    from pocketllm.engine.model_info import decode_weight_bytes

    with LLM(EngineArgs(model=tiny_checkpoint("qwen3"), device="cpu", quantization="fp8", num_kv_blocks=16)) as llm:
        model = llm._client.backend.core.runner.model
        head, table = model.lm_head.weight, model.embed_tokens.weight
        assert head.dtype == torch.float8_e4m3fn and table.dtype == torch.float32 and head.shape == table.shape
        params = dict(model.named_parameters())
        scales = sum(m.weight_scale.nbytes for m in model.modules() if getattr(m, "weight_scale", None) is not None)
        read = sum(p.nbytes for name, p in params.items() if name != "embed_tokens.weight") + scales
        assert decode_weight_bytes(model) == read
        assert llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids


def test_fp8_refuses_what_it_does_not_cover(tiny_checkpoint) -> None:
    with pytest.raises(InvalidRequestError, match="quantization"):
        EngineArgs(quantization="int8")
    with pytest.raises(InvalidRequestError, match="both choose"):
        EngineArgs(quantization="fp8", cpu_weight_format="int4")
    with pytest.raises(UnsupportedFeatureError, match="MoE experts"):
        LLM(EngineArgs(model=tiny_checkpoint("qwen3_moe"), device="cpu", quantization="fp8", num_kv_blocks=16))


def test_the_cli_takes_quantization() -> None:
    import argparse

    from pocketllm.cli.engine_flags import add_engine_flags, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_args_from(parser.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert engine_args_from(parser.parse_args([])).quantization is None
