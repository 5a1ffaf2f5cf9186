"""Architecture name (``config.architectures[0]``) → model class."""

from __future__ import annotations

from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.models.deepseek_v4 import DeepseekV4ForCausalLM
from pocketllm.models.gemma3 import Gemma3ForCausalLM
from pocketllm.models.llama import LlamaForCausalLM
from pocketllm.models.mistral import MistralForCausalLM
from pocketllm.models.qwen2 import Qwen2ForCausalLM
from pocketllm.models.qwen3 import Qwen3ForCausalLM
from pocketllm.models.qwen3_5 import Qwen3_5ForCausalLM
from pocketllm.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from pocketllm.models.qwen3_moe import Qwen3MoeForCausalLM

MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    # Hybrid Gated DeltaNet models (recurrent state per request; the loader hands us the text part of
    # Qwen3_5(Moe)ForConditionalGeneration checkpoints under these names).
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # Gemma 3 text (the loader hands us the text part of Gemma3ForConditionalGeneration checkpoints too).
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    # DeepSeek-V4 (compressed-history attention state per request; reference path on CPU).
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}


def model_class(hf_config) -> type[nn.Module]:
    """The class that implements ``hf_config``'s architecture, or a clear refusal."""
    names = list(getattr(hf_config, "architectures", None) or [])
    for name in names:
        if name in MODELS:
            return MODELS[name]
    raise UnsupportedFeatureError(
        f"architecture {names or '(none declared)'} is not supported; supported: {', '.join(sorted(MODELS))}")
