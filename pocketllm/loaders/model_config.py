"""A model's hyperparameters as read-only attributes, for checkpoints that carry no transformers config (GGUF).

The model classes read attributes only (``hidden_size``, ``rope_parameters``, ...), so a GGUF file's metadata
needs no transformers config class: importing one (with what it imports) costs over a second of a cold start on a
small CPU. Rope settings are spelled as transformers 5 spells them: ``rope_parameters`` holds ``rope_theta``,
``rope_type`` and the scaling parameters.
"""

from __future__ import annotations

from typing import Any


class ModelConfig:
    """``model_type`` and keyword hyperparameters, frozen once built."""

    def __init__(self, model_type: str, **params: Any) -> None:
        theta = params.pop("rope_theta", 10000.0)
        scaling = params.pop("rope_scaling", None) or {"rope_type": "default"}
        params.setdefault("rope_parameters", {**scaling, "rope_theta": theta})
        object.__setattr__(self, "_params", {"model_type": model_type, **params})

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_params"][name]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no {name!r}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only (set {name!r} when building it)")

    def to_dict(self) -> dict[str, Any]:
        """Every hyperparameter (a copy)."""
        return dict(self._params)

    def to_transformers(self) -> Any:
        """The equivalent transformers config (imports transformers' config classes)."""
        from transformers import AutoConfig

        params = self.to_dict()
        return AutoConfig.for_model(params.pop("model_type"), **params)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._params!r})"
