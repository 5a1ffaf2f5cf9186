"""Qwen2 / Qwen2.5: the Llama layout with biases on the q/k/v projections."""

from __future__ import annotations

from typing import Any

from pocketllm.models.llama import CausalLM
from pocketllm.models.windows import by_layer_type


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True

    def layer_windows(self, config: Any) -> list[int | None]:
        return by_layer_type(config)
