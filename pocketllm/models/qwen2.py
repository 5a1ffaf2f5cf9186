"""Qwen2 / Qwen2.5: the Llama layout with biases on the q/k/v projections."""

from pocketllm.models.llama import CausalLM


class Qwen2ForCausalLM(CausalLM):
    qkv_bias = True
