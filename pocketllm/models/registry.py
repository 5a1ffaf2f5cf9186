"""Architecture name (``config.architectures[0]``) → model class."""

from __future__ import annotations

from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.models.llama import LlamaForCausalLM
from pocketllm.models.qwen2 import Qwen2ForCausalLM
from pocketllm.models.qwen3 import Qwen3ForCausalLM
from pocketllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    """The class that implements ``hf_config``'s architecture, or a clear refusal."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise UnsupportedFeatureError(
        f"architecture {names or '(none declared)'} is not supported; supported: {', '.join(sorted(MODELS))}")
