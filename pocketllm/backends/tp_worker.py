"""A worker rank (rank > 0): load this rank's shard, then run the forward pass of every step rank 0 broadcasts
until it says stop. Started by the library (``python -m pocketllm.backends.tp_worker ARGS_JSON``), by
``pocketllm serve``'s supervisor, or as any rank but 0 of a ``pocketllm`` command an external launcher started."""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping

import torch

from pocketllm.config import EngineArgs
from pocketllm.distributed.group import RankInfo, destroy_group, init_group, loaded
from pocketllm.distributed.step_channel import StepChannel
from pocketllm.distributed.supervisor import HeldSignals, watch_parent
from pocketllm.errors import InvalidRequestError, PocketLLMError


def run_worker(args: EngineArgs, env: Mapping[str, str] | None = None, hold_signals: bool = False) -> int:
    """Join the group as the rank ``env`` names and serve steps until rank 0 stops; the exit status.
    ``hold_signals``: an external launcher started this rank (see ``HeldSignals``)."""
    from pocketllm.engine.engine_core import EngineCore
    from pocketllm.loaders.checkpoint import load_checkpoint
    from pocketllm.loaders.default_model import default_model_path
    from pocketllm.runner.model_runner import resolve_device

    info = RankInfo.from_env(os.environ if env is None else env, args.tensor_parallel_size)
    if info.rank == 0:
        raise InvalidRequestError("rank 0 runs the engine, not a worker", param="tensor_parallel_supervisor")
    watch_parent(info.parent_pid)
    held = HeldSignals(info.rank, args.tensor_parallel_shutdown_timeout) if hold_signals else None
    if held is not None:
        held.install()
    init_group(info, resolve_device(args.device), args.tensor_parallel_startup_timeout)
    try:
        checkpoint = load_checkpoint(args.model or default_model_path(), args.load_format, with_tokenizer=False)
        dummy = args.load_format == "dummy" or checkpoint.format == "dummy"
        weights = None if dummy else iter(checkpoint.weight_source)
        # The same construction as rank 0 (weights, recurrent-state pool, KV cache sizing agreed with rank 0);
        # the scheduler it also builds stays unused here.
        core = EngineCore(args, checkpoint.hf_config, weights, frozenset())
        loaded(info)
        serve_steps(core.runner)
        if held is not None:
            held.stopped()
    finally:
        destroy_group()
    return 0


@torch.inference_mode()
def serve_steps(runner) -> None:
    """Receive → forward → take part in the logits gather, as rank 0's ``ModelRunner.launch`` does."""
    channel = StepChannel()
    while (host := channel.receive()) is not None:
        runner.run_host_batch(host)   # (its logits end with the gather)


def main(argv: list[str] | None = None) -> int:
    """``python -m pocketllm.backends.tp_worker ENGINE_ARGS_JSON`` (the rank comes from the environment)."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if len(argv) != 1:
            raise InvalidRequestError("usage: python -m pocketllm.backends.tp_worker ENGINE_ARGS_JSON")
        return run_worker(EngineArgs(**json.loads(argv[0])))
    except PocketLLMError as exc:
        print(f"pocketllm worker: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
