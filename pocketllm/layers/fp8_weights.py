"""``quantization="fp8"``: a loaded model's linear layers and LM head re-held as float8 e4m3 weights with per-row
scales."""

from __future__ import annotations

from torch import nn

from pocketllm.errors import UnsupportedFeatureError
from pocketllm.layers.embedding import ParallelLMHead
from pocketllm.layers.linear import LinearBase
from pocketllm.layers.moe import FusedMoE


def quantize_model_fp8(model: nn.Module) -> int:
    """Quantise every linear layer of ``model`` (attention and MLP projections) and its LM head, and return how
    many; the token embedding keeps the compute dtype (its rows are looked up, not multiplied: a head tied to it
    gets codes of its own). A model whose other weights hold most of its bytes (MoE experts) is refused: they
    would stay unquantised."""
    moe = next((name for name, module in model.named_modules() if isinstance(module, FusedMoE)), None)
    if moe is not None:
        raise UnsupportedFeatureError(f"quantization='fp8' quantises dense linear layers; {type(model).__name__} "
                                      f"has MoE experts ({moe}), which it does not cover yet")
    layers = [module for module in model.modules() if isinstance(module, (LinearBase, ParallelLMHead))]
    if not layers:
        raise UnsupportedFeatureError(f"quantization='fp8': {type(model).__name__} has no linear layers it covers")
    for layer in layers:
        layer.quantize_fp8()
    return len(layers)
