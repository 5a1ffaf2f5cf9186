"""Mistral: the Llama layout with every layer attending over ``sliding_window`` tokens (where the config sets
one)."""

from __future__ import annotations

from typing import Any

from pocketllm.models.llama import CausalLM
from pocketllm.models.windows import every_layer


class MistralForCausalLM(CausalLM):
    def layer_windows(self, config: Any) -> list[int | None]:
        return every_layer(config)
