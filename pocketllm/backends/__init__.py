"""Backend selection: ``torch`` runs the PyTorch engine, ``cpp`` the native plane; ``auto`` follows the spec's
rule (``backends.native.auto_picks_native``)."""

from __future__ import annotations

from pocketllm.backends.native import auto_picks_native
from pocketllm.config import EngineArgs


def create_backend(args: EngineArgs):
    """Build the backend ``args.backend`` names (``auto`` resolved), refusing what this build cannot run."""
    if args.backend == "cpp" or (args.backend == "auto" and auto_picks_native(args)):
        from pocketllm.backends.cpp_backend import CppBackend

        return CppBackend(args)
    from pocketllm.backends.torch_backend import TorchBackend

    return TorchBackend(args)
