"""Which layers attend over a sliding window, read from a config as transformers reads it for each family.

A window of ``w`` lets a query at position ``p`` attend the keys at positions ``p - w + 1 .. p``: ``w`` tokens,
the query's own included (transformers' ``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``).
"""

from __future__ import annotations

from typing import Any

from pocketllm.errors import CheckpointError, UnsupportedFeatureError

SLIDING = "sliding_attention"
FULL = "full_attention"
# transformers' Qwen2/Qwen3 default for ``max_window_layers`` (the first layer that slides when the config
# enables the window and names no ``layer_types``).
DEFAULT_MAX_WINDOW_LAYERS = 28


def checked_window(config: Any) -> int | None:
    """``config.sliding_window`` as a positive int, or None where unset."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise CheckpointError(f"sliding_window must be a positive integer, not {window!r}")
    return window


def every_layer(config: Any) -> list[int | None]:
    """Mistral: every layer slides over ``sliding_window`` when the config sets one."""
    return [checked_window(config)] * config.num_hidden_layers


def every_layer_if_enabled(config: Any) -> list[int | None]:
    """Qwen3-MoE: every layer slides when ``use_sliding_window`` is true."""
    window = checked_window(config) if getattr(config, "use_sliding_window", False) else None
    return [window] * config.num_hidden_layers


def by_layer_type(config: Any) -> list[int | None]:
    """Qwen2/Qwen3: ``layer_types`` names the sliding layers; without it, the layers from ``max_window_layers``
    on slide when ``use_sliding_window`` is true."""
    window = checked_window(config) if getattr(config, "use_sliding_window", False) else None
    count = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        first = getattr(config, "max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        types = [SLIDING if window is not None and i >= first else FULL for i in range(count)]
    return _windows_of_types(list(types), window, count)


def every_named_layer(config: Any) -> list[int | None]:
    """Gemma 3: the ``layer_types`` entries named ``sliding_attention`` slide over ``sliding_window``."""
    return _windows_of_types(list(config.layer_types), checked_window(config), config.num_hidden_layers)


def _windows_of_types(types: list[str], window: int | None, count: int) -> list[int | None]:
    """Each layer's window from its ``layer_types`` entry, the names and count checked."""
    if len(types) != count:
        raise CheckpointError(f"layer_types names {len(types)} layers, the config has {count}")
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise UnsupportedFeatureError(f"layer_types {unknown} are not supported (only {FULL!r}, {SLIDING!r})")
    if SLIDING in types and window is None:
        raise CheckpointError(f"layer_types has {SLIDING!r} layers but the config sets no sliding_window "
                              "(or use_sliding_window is false)")
    return [window if kind == SLIDING else None for kind in types]
