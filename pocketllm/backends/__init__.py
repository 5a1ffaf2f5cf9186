"""Backend selection: ``auto`` and ``torch`` run the PyTorch engine; ``cpp`` is not built yet."""

from __future__ import annotations

from pocketllm.config import EngineArgs
from pocketllm.errors import UnsupportedFeatureError


def create_backend(args: EngineArgs):
    """Build the backend ``args.backend`` names, refusing what this build cannot run."""
    if args.backend == "cpp":
        raise UnsupportedFeatureError(
            "backend='cpp' (the native C++ plane) is not built in this release; use backend='torch' or 'auto'")
    from pocketllm.backends.torch_backend import TorchBackend

    return TorchBackend(args)
