"""Local tensor-parallel ranks as child processes: started without a shell, watched, stopped and reaped.

The group gets a private run directory (under ``tensor_parallel_rendezvous_dir`` when given, a parent that is
never removed); it holds the rendezvous store (through which NCCL exchanges its unique id) and the ranks'
``started-<rank>``/``ready-<rank>`` marks, and is removed when the group is.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

from pocketllm.config import EngineArgs
from pocketllm.distributed.group import INIT_METHOD_VAR, PARENT_PID_VAR, RUN_DIR_VAR
from pocketllm.errors import EngineDeadError

POLL = 0.05
# After rank 0 exits, the other ranks get this long to leave on their own before they are asked to.
WORKER_GRACE = 1.0


def _free_port() -> int:
    """A TCP port free on this host now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _stderr(message: str) -> None:
    """The supervisor's progress lines (rank pids, readiness, why it stops)."""
    print(f"pocketllm: {message}", file=sys.stderr, flush=True)


class RankGroup:
    """Ranks ``ranks`` (of ``args.tensor_parallel_size``) of one tensor-parallel group, each running ``argv``."""

    def __init__(self, argv: list[str], args: EngineArgs, ranks: range,
                 report: Callable[[str], None] = _stderr) -> None:
        self.argv = list(argv)
        self.world_size = args.tensor_parallel_size
        self.ranks = ranks
        self.startup_timeout = args.tensor_parallel_startup_timeout
        self.shutdown_timeout = args.tensor_parallel_shutdown_timeout
        self.report = report
        parent = args.tensor_parallel_rendezvous_dir or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.run_dir = tempfile.mkdtemp(prefix="pocketllm-tp-", dir=parent)   # mode 0700: private to this user
        self.rendezvous: dict[str, str]
        if args.tensor_parallel_master_addr is not None or args.tensor_parallel_master_port is not None:
            port = args.tensor_parallel_master_port or _free_port()
            addr = args.tensor_parallel_master_addr or "127.0.0.1"
            host = f"[{addr}]" if ":" in addr else addr
            self.rendezvous = {INIT_METHOD_VAR: f"tcp://{host}:{port}", "MASTER_ADDR": addr,
                               "MASTER_PORT": str(port)}
        else:
            store = os.path.join(self.run_dir, "rendezvous.store")
            self.rendezvous = {INIT_METHOD_VAR: f"file://{store}"}
        self.procs: dict[int, subprocess.Popen] = {}

    def rank_env(self, rank: int) -> dict[str, str]:
        """The variables that tell a process which rank it is and how the group meets."""
        return {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.world_size), "TP_RANK": str(rank), "TP_WORLD": str(self.world_size),
                RUN_DIR_VAR: self.run_dir, PARENT_PID_VAR: str(os.getpid()), **self.rendezvous}

    def start(self) -> None:
        """Start every rank (own session, so a terminal's Ctrl-C reaches only the supervisor)."""
        for rank in self.ranks:
            proc = subprocess.Popen(self.argv, env={**os.environ, **self.rank_env(rank)}, start_new_session=True)
            self.procs[rank] = proc
            self.report(f"tensor-parallel rank {rank} started (pid {proc.pid})")

    def marked(self, what: str) -> bool:
        """Whether every rank of this group left its ``what`` mark."""
        return all(os.path.exists(os.path.join(self.run_dir, f"{what}-{rank}")) for rank in self.ranks)

    def exited(self) -> tuple[int, int] | None:
        """(rank, exit code) of the first rank found to have exited, or None while all run."""
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                return rank, code
        return None

    def wait_marked(self, what: str, timeout: float) -> None:
        """Block until every rank left ``what``; raise EngineDeadError if one exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while not self.marked(what):
            failed = self.exited()
            if failed is not None:
                raise EngineDeadError(f"tensor-parallel rank {failed[0]} exited with code {failed[1]} during startup")
            if time.monotonic() > deadline:
                raise EngineDeadError(f"tensor-parallel ranks did not start within {timeout:g} s")
            time.sleep(POLL)

    def stop(self, together: bool = False) -> None:
        """Ask rank 0 to stop (SIGTERM), then the others (``together``: all at once, e.g. before they loaded);
        kill whatever is left at the shutdown timeout."""
        deadline = time.monotonic() + self.shutdown_timeout
        leader = self.procs.get(0)
        if together:
            first = list(self.procs.values())
        else:   # without rank 0 here (the library is rank 0), the workers first get the grace to leave
            first = [leader] if leader is not None else []
        for proc in first:
            if proc.poll() is None:
                proc.terminate()
        leader_done: float | None = None
        asked = together
        while True:
            alive = [proc for proc in self.procs.values() if proc.poll() is None]
            if not alive:
                return
            now = time.monotonic()
            if leader is None or leader.poll() is not None:
                leader_done = leader_done or now
                if not asked and now - leader_done >= WORKER_GRACE:
                    for proc in alive:
                        proc.terminate()
                    asked = True
            if now > deadline:
                for proc in alive:
                    proc.kill()
                for proc in alive:
                    proc.wait()
                self.report(f"killed {len(alive)} tensor-parallel rank(s) still running after "
                            f"{self.shutdown_timeout:g} s")
                return
            time.sleep(POLL)

    def remove(self) -> None:
        """Delete the private run directory (never its parent)."""
        shutil.rmtree(self.run_dir, ignore_errors=True)


def watch_parent(parent_pid: int | None, interval: float = 0.5) -> None:
    """Exit this rank if the process that started it is gone (a supervisor killed without cleaning up)."""
    if parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval)
        os._exit(1)

    threading.Thread(target=watch, name="pocketllm-parent-watch", daemon=True).start()


class HeldSignals:
    """SIGINT/SIGTERM on a worker rank an external launcher (torchrun) started.

    A launcher that stops a job signals every rank at once, and rank 0 then drains its requests, which needs
    every other rank's share of each step: so a worker keeps serving rank 0's steps until rank 0 stops the
    group. A second signal, or ``grace`` seconds without rank 0's stop, makes it leave at once (status 1).
    The worker's main thread waits inside a collective, where Python signal handlers do not run: the signals
    are read from the interpreter's wakeup file descriptor by a thread of their own."""

    def __init__(self, rank: int, grace: float, report: Callable[[str], None] = _stderr) -> None:
        self.rank = rank
        self.grace = grace
        self.report = report
        self.received: signal.Signals | None = None

    def install(self) -> None:
        """From the main thread: hold SIGINT and SIGTERM from here on."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda number, frame: None)   # (the byte on the wakeup descriptor is the signal)
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_end,), name="pocketllm-held-signals", daemon=True).start()

    def _watch(self, fd: int) -> None:
        held = self._wait(fd, None)
        self.received = held[0]
        if len(held) == 1:
            self.report(f"rank {self.rank}: {held[0].name}: serving rank 0's last steps until it stops the group (a "
                        f"second signal, or {self.grace:g} s without its stop, leaves at once)")
            more = self._wait(fd, self.grace)
            if not more:
                self.report(f"rank {self.rank}: rank 0 did not stop the group within {self.grace:g} s; leaving")
                os._exit(1)
            held += more
        self.report(f"rank {self.rank}: a second signal ({held[1].name}): leaving now")
        os._exit(1)

    @staticmethod
    def _wait(fd: int, timeout: float | None) -> list[signal.Signals]:
        """The held signals read from the wakeup descriptor; [] when ``timeout`` seconds pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return []
            held = [signal.Signals(n) for n in os.read(fd, 64) if n in (signal.SIGINT, signal.SIGTERM)]
            if held:
                return held

    def stopped(self) -> None:
        """The worker loop ended: rank 0 stopped the group."""
        if self.received is not None:
            self.report(f"rank {self.rank}: rank 0 stopped the group; leaving")


def supervise(argv: list[str], args: EngineArgs, report: Callable[[str], None] = _stderr) -> int:
    """Run every rank of ``argv`` (rank 0 serves) until a signal, a rank's exit or the startup timeout; then stop
    and reap the whole group. The exit status: 0 after a requested stop, 1 after a failure."""
    group = RankGroup(argv, args, range(args.tensor_parallel_size), report)
    requested: list[int] = []
    previous = {sig: signal.signal(sig, lambda number, frame: requested.append(number))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    status = 1
    ready = False
    try:
        group.start()
        deadline = time.monotonic() + group.startup_timeout
        while True:
            if requested:
                report(f"{signal.Signals(requested[0]).name}: stopping the tensor-parallel group")
                status = 0
                break
            failed = group.exited()
            if failed is not None:
                report(f"tensor-parallel rank {failed[0]} exited with code {failed[1]}; stopping the group")
                break
            if not ready:
                if group.marked("ready"):
                    ready = True
                    report(f"all {group.world_size} tensor-parallel ranks loaded; rank 0 serves")
                elif time.monotonic() > deadline:
                    report(f"tensor-parallel ranks not ready within {group.startup_timeout:g} s; stopping the group")
                    break
            time.sleep(POLL)
    finally:
        group.stop(together=not ready)   # a rank still loading may be waiting for one that already left
        group.remove()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return status
