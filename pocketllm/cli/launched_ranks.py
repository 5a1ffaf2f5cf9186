"""Ranks an external launcher (torchrun) started: one command line on every rank, rank 0 runs the command.

With ``tensor_parallel_size > 1`` and ``--no-tensor-parallel-supervisor``, each process reads its rank from the
launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): rank 0 goes on with the command (it runs the
engine), every other rank runs the tensor-parallel worker loop and exits 0 when rank 0 stops the group. A
worker holds an external launcher's SIGINT/SIGTERM until rank 0 has drained and stopped the group (a second
signal, or ``tensor_parallel_shutdown_timeout`` seconds, ends it at once).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pocketllm.config import EngineArgs
from pocketllm.errors import InvalidRequestError


def launched_rank(engine_args: EngineArgs, env: Mapping[str, str] | None = None) -> int | None:
    """None when this process runs the command (no external launcher, or rank 0); else, on a worker rank, serve
    rank 0's steps and return the exit status. An environment that disagrees with the flags raises."""
    env = os.environ if env is None else env
    size = engine_args.tensor_parallel_size
    if engine_args.tensor_parallel_supervisor:
        return None
    if size == 1:
        world = env.get("WORLD_SIZE", "1")
        if world.strip() != "1":
            raise InvalidRequestError(
                f"the environment says WORLD_SIZE={world} (an external launcher's ranks), but tensor_parallel_size "
                "is 1: give --tensor-parallel-size equal to the launcher's world size",
                param="tensor_parallel_size")
        return None
    from pocketllm.distributed.group import RankInfo

    info = RankInfo.from_env(env, size)
    if info.rank == 0:
        return None
    from pocketllm.backends.tp_worker import run_worker

    # A launcher signals every rank at once; ``pocketllm serve``'s own supervisor (it sets the parent pid) signals
    # a worker only once rank 0 has gone, when there is nothing left to serve.
    return run_worker(engine_args, env, hold_signals=info.parent_pid is None)
