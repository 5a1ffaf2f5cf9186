"""Joining and leaving the tensor-parallel process group (gloo on CPU, NCCL on CUDA) from rank variables."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pocketllm.distributed import set_joined
from pocketllm.errors import InvalidRequestError, UnsupportedFeatureError

# The environment a supervisor (ours or torchrun) gives each rank; ours adds the POCKETLLM_TP_* entries.
INIT_METHOD_VAR = "POCKETLLM_TP_INIT_METHOD"    # file://<run dir>/rendezvous.store or tcp://ADDR:PORT
RUN_DIR_VAR = "POCKETLLM_TP_RUN_DIR"            # where ranks leave their started-/ready- marks
PARENT_PID_VAR = "POCKETLLM_TP_PARENT_PID"      # a rank exits when this process is gone

# Workers wait for rank 0's next step without a bound: an idle server must not time them out.
STEP_WAIT = datetime.timedelta(days=365)

_step_group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in the group and how the group meets."""

    rank: int
    world_size: int
    local_rank: int
    init_method: str
    run_dir: str | None = None
    parent_pid: int | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str], world_size: int) -> RankInfo:
        """Read RANK/WORLD_SIZE/LOCAL_RANK (and TP_RANK/TP_WORLD when set), checked against ``world_size``."""
        missing = [name for name in ("RANK", "WORLD_SIZE") if name not in env]
        if missing:
            raise InvalidRequestError(
                f"tensor_parallel_size={world_size} without the supervisor needs {' and '.join(missing)} in the "
                "environment (set by torchrun or the launcher); or leave the supervisor on",
                param="tensor_parallel_supervisor")
        try:
            rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
            local_rank = int(env.get("LOCAL_RANK", rank))
            tp = (int(env.get("TP_RANK", rank)), int(env.get("TP_WORLD", size)))
            parent = int(env[PARENT_PID_VAR]) if env.get(PARENT_PID_VAR) else None
        except ValueError as exc:
            raise InvalidRequestError(f"a rank variable in the environment is not an integer: {exc}") from None
        if size != world_size or tp != (rank, size) or not 0 <= rank < size:
            raise InvalidRequestError(
                f"the environment says rank {rank} of {size} (TP_RANK {tp[0]}, TP_WORLD {tp[1]}); "
                f"tensor_parallel_size is {world_size}: one tensor-parallel group spans every rank",
                param="tensor_parallel_size")
        init_method = env.get(INIT_METHOD_VAR, "env://")
        absent = [name for name in ("MASTER_ADDR", "MASTER_PORT") if init_method == "env://" and not env.get(name)]
        if absent:
            raise InvalidRequestError(
                f"rank {rank} of {size} without the supervisor needs {' and '.join(absent)} in the environment "
                "(set by torchrun or the launcher): where rank 0 meets the others",
                param="tensor_parallel_supervisor")
        return cls(rank, size, local_rank, init_method, env.get(RUN_DIR_VAR) or None, parent)


def backend_for(device: torch.device) -> str:
    """The collective backend of the model's tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_group(info: RankInfo, device: torch.device, timeout: float) -> torch.device:
    """Join the group (``timeout`` seconds bound the rendezvous and every model collective); returns this rank's
    device (``cuda:LOCAL_RANK`` on CUDA)."""
    global _step_group
    if dist.is_initialized():
        raise UnsupportedFeatureError("this process already belongs to a torch.distributed process group (another "
                                      "tensor-parallel engine?): run one tensor-parallel engine per process")
    if device.type == "cuda":
        if info.local_rank >= torch.cuda.device_count():
            raise UnsupportedFeatureError(
                f"tensor-parallel local rank {info.local_rank} needs cuda:{info.local_rank}, but this host has "
                f"{torch.cuda.device_count()} CUDA device(s)")
        device = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(device)
    mark(info, "started")
    dist.init_process_group(backend_for(device), init_method=info.init_method, rank=info.rank,
                            world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout))
    # Step broadcasts carry host integers: a gloo group on every device (an idle worker then waits on a socket,
    # not in a device kernel), whose wait has no practical bound (see STEP_WAIT).
    try:
        _step_group = dist.new_group(backend="gloo", timeout=STEP_WAIT)
    except BaseException:
        dist.destroy_process_group()
        raise
    set_joined(True)
    return device


def step_group() -> dist.ProcessGroup | None:
    """The group that carries rank 0's step broadcasts (None outside tensor parallelism)."""
    return _step_group


def loaded(info: RankInfo) -> None:
    """Wait until every rank has loaded its shard, then leave this rank's ready mark for the supervisor."""
    dist.barrier()
    mark(info, "ready")


def destroy_group() -> None:
    """Leave the group (safe to call when it is already gone)."""
    global _step_group
    _step_group = None
    set_joined(False)
    if dist.is_initialized():
        dist.destroy_process_group()


def mark(info: RankInfo, what: str) -> None:
    """Leave ``<what>-<rank>`` in the run directory (how the supervisor follows the ranks' progress)."""
    if info.run_dir is not None:
        with open(os.path.join(info.run_dir, f"{what}-{info.rank}"), "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
