"""Rank 0's side of tensor parallelism: start the worker ranks (or join ranks a launcher started), signal
readiness once every rank has loaded, and stop and reap the group."""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import sys

import torch

from pocketllm.config import EngineArgs
from pocketllm.distributed.group import RankInfo, destroy_group, init_group, loaded
from pocketllm.distributed.step_channel import StepChannel
from pocketllm.distributed.supervisor import RankGroup, watch_parent
from pocketllm.errors import InvalidRequestError

logger = logging.getLogger("pocketllm.distributed")


def worker_argv(args: EngineArgs) -> list[str]:
    """The command of a worker rank the library starts (no shell; the engine args travel as JSON)."""
    payload = json.dumps(dataclasses.asdict(args.replace(tensor_parallel_supervisor=False)))
    return [sys.executable, "-m", "pocketllm.backends.tp_worker", payload]


class EngineGroup:
    """The tensor-parallel group as rank 0 (the process that schedules) sees it."""

    def __init__(self, args: EngineArgs, device: torch.device) -> None:
        size = args.tensor_parallel_size
        self.spawned: RankGroup | None = None
        self.closed = False
        if args.tensor_parallel_supervisor:
            self.spawned = RankGroup(worker_argv(args), args, range(1, size), report=logger.info)
            info = RankInfo.from_env(self.spawned.rank_env(0), size)
            atexit.register(self._reap)
            try:
                self.spawned.start()
                self.spawned.wait_marked("started", args.tensor_parallel_startup_timeout)
            except BaseException:
                self._reap()
                raise
        else:
            info = RankInfo.from_env(os.environ, size)
            if info.rank != 0:
                raise InvalidRequestError(
                    f"this process is rank {info.rank}: only rank 0 runs the engine; the other ranks run "
                    "the worker loop (run_worker; the pocketllm commands turn every rank but 0 into a worker)",
                    param="tensor_parallel_supervisor")
            watch_parent(info.parent_pid)
        self.info = info
        try:
            init_group(info, device, args.tensor_parallel_startup_timeout)
        except BaseException:
            self._reap()
            raise

    def loaded(self) -> None:
        """Every rank has loaded its shard: rank 0 is ready from here on."""
        loaded(self.info)

    def close(self, clean: bool) -> None:
        """Tell the workers to stop (``clean``: the step channel is idle and sound), leave the group, reap."""
        if self.closed:
            return
        self.closed = True
        if clean:
            try:
                StepChannel().send_stop()
            except Exception as exc:  # a worker already gone: it is reaped below
                logger.warning("could not send the stop message to the tensor-parallel workers: %s", exc)
        try:
            destroy_group()
        except Exception as exc:
            logger.warning("leaving the tensor-parallel group failed: %s", exc)
        self._reap()

    def _reap(self) -> None:
        """Stop the worker ranks this process started (also at interpreter exit) and remove their run directory."""
        if self.spawned is not None:
            self.spawned.stop()
            self.spawned.remove()
            self.spawned = None
        atexit.unregister(self._reap)
