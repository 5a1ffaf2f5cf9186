"""What the loaded model is: sizes, dtype and device, read from the module the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ModelInfo:
    """The engine's model as benchmarks and reports describe it."""

    architecture: str
    vocab_size: int
    num_parameters: int       # weights of every layer, whatever format holds them (a tied table counted once)
    weight_bytes: int         # bytes a batch-1 decode step reads from the weights (``decode_weight_bytes``)
    dtype: str                # the compute dtype
    device: str
    max_model_len: int


def describe_model(core) -> ModelInfo:
    """The ``ModelInfo`` of an ``EngineCore``'s model."""
    model = core.runner.model
    architectures = getattr(core.runner.hf_config, "architectures", None) or ["?"]
    return ModelInfo(architecture=architectures[0], vocab_size=int(core.vocab_size),
                     num_parameters=num_parameters(model), weight_bytes=decode_weight_bytes(model),
                     dtype=str(core.dtype).removeprefix("torch."), device=str(core.device),
                     max_model_len=int(core.max_model_len))


def num_parameters(model: torch.nn.Module) -> int:
    """Elements of the model's weights: its parameters once each, plus the layers held in a CPU weight format."""
    from pocketllm.layers.quantized_linear import CpuLinear, RescoredLMHead

    inner = {id(m.inner) for m in model.modules() if isinstance(m, RescoredLMHead)}
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for m in model.modules():
        if isinstance(m, CpuLinear) and id(m) not in inner:
            total += m.out_features * m.in_features + (m.bias.numel() if m.bias is not None else 0)
    return total


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a batch-1 decode step reads from the weights: every parameter once, except an untied embedding
    table (one row per token is read from it) and routed experts (``top_k`` of ``num_experts`` per layer), plus
    the layers held in a CPU weight format (bfloat16, int4) or a float8 LM head, whose own head then replaces the
    tied table, and the scales of float8 weights."""
    from pocketllm.layers.embedding import ParallelLMHead
    from pocketllm.layers.quantized_linear import CpuLinear, RescoredLMHead

    total = sum(m.weight_bytes() for m in model.modules() if isinstance(m, (CpuLinear, RescoredLMHead)))
    # float8 weights (``quantization="fp8"``): their per-row scales, held beside the parameters
    total += sum(m.weight_scale.nbytes for m in model.modules() if getattr(m, "weight_scale", None) is not None)
    # a head of a CPU weight format, or a float8 head (``quantization="fp8"``), holds weights of its own: a table
    # tied to it is then only looked up
    head = getattr(model, "lm_head", None)
    own_head = head is not None and (not isinstance(head, ParallelLMHead) or head.weight_scale is not None)
    seen = set()
    tied = bool(getattr(model, "tie_word_embeddings", False)) and not own_head
    experts = {id(p): m.top_k / m.num_experts for m in model.modules() if type(m).__name__ == "FusedMoE"
               for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        if "embed_tokens" in name and not tied:
            continue
        total += int(param.numel() * param.element_size() * experts.get(id(param), 1.0))
    return total
