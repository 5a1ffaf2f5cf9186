"""Qwen3 dense: the Llama layout with per-head RMSNorm on queries and keys."""

from __future__ import annotations

from typing import Any

from pocketllm.models.llama import CausalLM
from pocketllm.models.windows import by_layer_type


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True

    def layer_windows(self, config: Any) -> list[int | None]:
        return by_layer_type(config)
