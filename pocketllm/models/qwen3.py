"""Qwen3 dense: the Llama layout with per-head RMSNorm on queries and keys."""

from pocketllm.models.llama import CausalLM


class Qwen3ForCausalLM(CausalLM):
    qk_norm = True
